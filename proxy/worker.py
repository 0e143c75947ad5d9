"""The proxy's gunicorn worker: gevent (one greenlet per connection, so idle and slow clients cost a few kB each,
not a thread), with a deadline on every request's headers and gunicorn's own errors in JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import gevent
from gunicorn.workers.ggevent import GeventWorker

from lifecycle.raw_errors import JsonErrors

if TYPE_CHECKING:
    from .__main__ import ProxyServer


class ProxyWorker(JsonErrors, GeventWorker):
    def timeout_ctx(self):  # (gunicorn's stubs say None; the gevent worker returns a Timeout, as this one does)
        # gunicorn applies this around reading each request's headers (and waiting for the next request on a
        # kept-alive connection); when it passes, the connection is closed without an answer
        app = cast("ProxyServer", self.app)  # the application that names this worker class
        # exception=False: a silent timeout (gevent's documented form; its stubs accept only an exception or None)
        return gevent.Timeout(app.proxy_config.header_timeout, False)  # type: ignore[arg-type]
