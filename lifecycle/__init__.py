"""Process life cycle shared by the inference server and the proxy: draining on SIGTERM/SIGINT under gunicorn,
read deadlines for slow clients."""
