"""The Flask app factory: gunicorn's wsgi_app points here (``inference_api.app:create_app()``)."""
from __future__ import annotations

import atexit
import logging
import os

from flask import Flask, current_app, request

from .config import ServerConfig
from .engine_client import EngineClient
from .errors import register_error_handlers


def create_app(config: ServerConfig | None = None) -> Flask:
    config = config or ServerConfig.from_env(os.environ)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    client = EngineClient(config).start()
    atexit.register(client.shutdown)
    app.extensions["server_config"] = config
    app.extensions["engine_client"] = client
    register_error_handlers(app)

    @app.after_request
    def count_answer(response):
        client.metrics.answered(request.path, response.status_code)
        return response

    from .routes_native import native
    from .routes_openai import openai_api
    from .routes_tgi import tgi

    app.register_blueprint(native)
    app.register_blueprint(openai_api)
    app.register_blueprint(tgi)
    return app


def engine_client() -> EngineClient:
    return current_app.extensions["engine_client"]


def server_config() -> ServerConfig:
    return current_app.extensions["server_config"]
