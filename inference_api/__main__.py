"""``python -m inference_api [flags]``: check that the model fits, then serve with gunicorn (one gthread worker)."""

from __future__ import annotations

import os
import sys

from gunicorn.app.base import BaseApplication

from lifecycle.drain import DrainingArbiter, drain_on_signals, gunicorn_settings

from .config import ServerConfig
from .engine.preflight import Estimate, PreflightError, check_servable, preflight


class Server(BaseApplication):
    def __init__(self, config: ServerConfig, estimate: Estimate | None = None):
        self.server_config = config
        self.estimate = estimate
        super().__init__()

    def load_config(self) -> None:
        c = self.server_config
        options = {
            "bind": f"{c.host}:{c.port}",
            "workers": 1,
            "worker_class": "inference_api.web.worker.ServerWorker",
            "threads": c.threads,
            "timeout": 120,
            "keepalive": 5,
            "loglevel": c.log_level,
            "accesslog": None,  # the app writes one structured line per request
            **gunicorn_settings(c.drain_timeout),
            "post_worker_init": lambda worker: drain_on_signals(worker, worker.wsgi.extensions["drain"]),
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from .web.app import create_app  # imported in the worker: the engine process belongs to it

        return create_app(self.server_config, self.estimate)

    def run(self) -> None:
        DrainingArbiter(self).run()


def main(argv: list[str] | None = None) -> None:
    config = ServerConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    try:
        check_servable(config)  # (a file the server cannot serve stops the start, whatever --skip-preflight says)
        estimate = preflight(config)
    except PreflightError as exc:
        print(f"python -m inference_api: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    Server(config, estimate).run()


if __name__ == "__main__":
    main()
