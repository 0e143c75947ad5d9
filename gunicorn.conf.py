"""gunicorn settings: one gthread worker (the engine process is its child), one thread per open stream.

    gunicorn --config gunicorn.conf.py            # the model and every other setting come from the environment
    MOCK_MODEL=1 gunicorn --config gunicorn.conf.py
"""
import os

wsgi_app = "inference_api.app:create_app()"
bind = f"{os.environ.get('HOST', '127.0.0.1')}:{os.environ.get('PORT', '8000')}"
workers = 1
worker_class = "gthread"
threads = int(os.environ.get("THREADS", "128"))
timeout = 120
graceful_timeout = 10
keepalive = 5
loglevel = os.environ.get("LOG_LEVEL", "info")
control_socket_disable = True  # its default path is shared by every gunicorn of the same user
