"""The Flask app factory: gunicorn's wsgi_app points here (``inference_api.app:create_app()``)."""
from __future__ import annotations

import atexit
import logging
import os

from flask import Flask

from .config import ServerConfig
from .engine_client import EngineClient
from .errors import register_error_handlers, request_api
from .llama_stack import llama_stack_blueprint
from .routes_native import native_blueprint
from .routes_openai import openai_blueprint
from .routes_shared import shared_blueprint
from .routes_tgi import tgi_blueprint
from .serving import Serving


def create_app(config: ServerConfig | None = None) -> Flask:
    config = config or ServerConfig.from_env(os.environ)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False
    client = EngineClient(config).start()
    atexit.register(client.shutdown)
    register_error_handlers(app)

    @app.after_request
    def count_answer(response):
        client.metrics.answered(request_api(), response.status_code)
        return response

    serving = Serving(client, config)
    # /inference/completion and /inference/chat_completion (llama-stack) are fixed paths: they win over the
    # native API's /inference/<path:model>
    for blueprint in (llama_stack_blueprint, native_blueprint, openai_blueprint, tgi_blueprint, shared_blueprint):
        app.register_blueprint(blueprint(serving))
    return app
