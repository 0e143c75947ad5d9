"""``python -m proxy [flags]``: serve the proxy with gunicorn (one gevent worker: a greenlet per connection)."""

from __future__ import annotations

import os
import sys

from gunicorn.app.base import BaseApplication

from lifecycle.drain import DrainingArbiter, drain_on_signals, gunicorn_settings

from .config import ConfigError, ProxyConfig


class ProxyServer(BaseApplication):
    def __init__(self, config: ProxyConfig):
        self.proxy_config = config
        super().__init__()

    def load_config(self) -> None:
        c = self.proxy_config
        host = f"[{c.host}]" if ":" in c.host else c.host
        # one worker: without Redis the per-team limit is counted in-process; greenlets carry the connections, so
        # a thousand idle or trickling clients cost little and never starve a legitimate request
        options = {
            "bind": f"{host}:{c.port}",
            "workers": 1,
            "worker_class": "proxy.worker.ProxyWorker",
            "worker_connections": c.max_connections,
            "timeout": 30,
            "keepalive": 5,
            **gunicorn_settings(c.drain_timeout),
            "loglevel": c.log_level,
            "post_worker_init": lambda worker: drain_on_signals(worker, worker.wsgi.extensions["drain"]),
            "accesslog": None,
        }  # the app writes its own JSON access log
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app

        return create_app(self.proxy_config)

    def run(self) -> None:
        DrainingArbiter(self).run()


def main(argv: list[str] | None = None) -> None:
    try:
        config = ProxyConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as exc:
        print(f"python -m proxy: error: {exc}", file=sys.stderr)
        sys.exit(2)
    ProxyServer(config).run()


if __name__ == "__main__":
    main()
