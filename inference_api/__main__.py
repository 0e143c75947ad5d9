"""``python -m inference_api [flags]``: serve with gunicorn (gthread, one worker)."""
from __future__ import annotations

import os
import sys

from gunicorn.app.base import BaseApplication

from .config import ServerConfig


class Server(BaseApplication):
    def __init__(self, config: ServerConfig):
        self.server_config = config
        super().__init__()

    def load_config(self) -> None:
        c = self.server_config
        options = {"bind": f"{c.host}:{c.port}", "workers": 1, "worker_class": "gthread", "threads": c.threads,
                   "timeout": 120, "graceful_timeout": 10, "keepalive": 5, "loglevel": c.log_level,
                   "accesslog": "-" if c.log_level == "debug" else None,
                   # the control socket has one default path per user: two servers (or the proxy) would share it
                   "control_socket_disable": True}
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from .app import create_app  # imported in the worker: the engine process belongs to it

        return create_app(self.server_config)


def main(argv: list[str] | None = None) -> None:
    config = ServerConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    Server(config).run()


if __name__ == "__main__":
    main()
