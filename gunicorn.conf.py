"""gunicorn settings: one gthread worker (the engine process is its child), one thread per open stream.

    gunicorn --config gunicorn.conf.py            # the model and every other setting come from the environment
    MOCK_MODEL=1 gunicorn --config gunicorn.conf.py

SIGTERM drains (see docs/operations.md); under plain gunicorn SIGINT stops at once, as gunicorn's own.
"""

import os
import sys

from inference_api.config import ServerConfig
from inference_api.engine.preflight import PreflightError, preflight
from lifecycle.drain import drain_on_signals, gunicorn_settings

_server = ServerConfig.from_env(os.environ)

wsgi_app = "inference_api.web.app:create_app()"
bind = f"{_server.host}:{_server.port}"
workers = 1
worker_class = "inference_api.web.worker.ServerWorker"  # gthread with a header deadline
threads = _server.threads
timeout = 120
_shared = gunicorn_settings(_server.drain_timeout)  # what the proxy's gunicorn has too
graceful_timeout = _shared["graceful_timeout"]
keepalive = 5
loglevel = _server.log_level
control_socket_disable = _shared["control_socket_disable"]
forwarded_allow_ips = _shared["forwarded_allow_ips"]


def on_starting(server):
    try:
        preflight(_server)
    except PreflightError as exc:
        print(exc, file=sys.stderr, flush=True)
        sys.exit(2)


def post_worker_init(worker):
    drain_on_signals(worker, worker.wsgi.extensions["drain"])
