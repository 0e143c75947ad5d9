"""The proxy's gunicorn worker: gevent (one greenlet per connection, so idle and slow clients cost a few kB each,
not a thread), with a deadline on every request's headers and gunicorn's own errors in JSON."""

from __future__ import annotations

import gevent
from gunicorn.workers.ggevent import GeventWorker

from lifecycle.raw_errors import JsonErrors


class ProxyWorker(JsonErrors, GeventWorker):
    def timeout_ctx(self):
        # gunicorn applies this around reading each request's headers (and waiting for the next request on a
        # kept-alive connection); when it passes, the connection is closed without an answer
        return gevent.Timeout(self.app.proxy_config.header_timeout, False)
