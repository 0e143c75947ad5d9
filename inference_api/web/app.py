"""The Flask app factory: gunicorn's wsgi_app points here (``inference_api.web.app:create_app()``)."""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import time

from flask import Flask, g, has_request_context, request

from lifecycle.access_log import AccessLog, request_id
from lifecycle.deadlines import BodyTimeout, Watchdog, close_when_asked, read_capped
from lifecycle.drain import Drain
from lifecycle.internal import INTERNAL_HEADER
from lifecycle.quota import Reservation, Store, TeamLimits

from ..config import ServerConfig
from ..engine.client import EngineClient, Session
from ..engine.preflight import Estimate
from .dialects.anthropic.routes import anthropic_blueprint
from .dialects.embeddings.routes import embeddings_blueprint
from .dialects.llama_stack.routes import llama_stack_blueprint
from .dialects.native.routes import health_blueprint, native_blueprint
from .dialects.openai.routes import openai_blueprint
from .dialects.responses.routes import responses_blueprint
from .dialects.shared import shared_blueprint
from .dialects.tgi.routes import tgi_blueprint
from .errors import ApiError, error_response, register_error_handlers, request_api
from .models import ModelPool
from .serving import RESERVATION_KEY, Serving
from .streaming import SESSION_KEY


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = g.get("request_id", "-") if has_request_context() else "-"
        return True


def create_app(config: ServerConfig | None = None, estimate: Estimate | None = None) -> Flask:
    config = config or ServerConfig.from_env(os.environ)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RequestIdFilter())
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # app.json is a DefaultJSONProvider, typed as its base
    client = EngineClient(config).start()  # the first model's engine, started with the server
    models = ModelPool(config, client, estimate)  # and every other model, started when a request names it
    atexit.register(models.shutdown)
    app.extensions["server_config"] = config
    drain = Drain(config.drain_timeout, lambda: models.open_sessions, models.abort_all, models.shutdown)
    app.extensions["drain"] = drain  # gunicorn's post_worker_init starts it on SIGTERM/SIGINT
    access_log = AccessLog()
    watchdog = Watchdog()
    # each team's tokens per minute (the team: the proxy's X-Team-Id), reserved on admission and settled when the
    # answer ends, shared through Redis when given
    limits = TeamLimits(
        Store(config.redis_url),
        tokens_per_minute=config.tokens_per_minute_per_team,
        prompt_token_weight=config.prompt_token_weight,
    )
    client.metrics.watch(
        "inference_quota_redis_fallbacks",
        "team-quota operations counted in this process because Redis failed (0 without Redis)",
        lambda: limits.store.fallbacks,
    )
    app.wsgi_app = close_when_asked(app.wsgi_app)  # type: ignore[method-assign]  # Flask's documented middleware form
    register_error_handlers(app)

    @app.before_request
    def admit():
        g.started = time.monotonic()
        g.request_id = request_id(request.headers.get("X-Request-Id"))
        if (
            config.internal_secret
            and not (request.path == "/health" and request.method in ("GET", "HEAD"))
            and not hmac.compare_digest(
                request.headers.get(INTERNAL_HEADER, "").encode(), config.internal_secret.encode()
            )
        ):
            raise ApiError(403, "this server answers its proxy only (the request lacks the internal secret)")
        if request.method == "POST":  # the whole body within its deadline (cached for the route)
            try:
                watchdog.read_body(request.environ, lambda: read_capped(request), config.body_timeout)
            except BodyTimeout as exc:
                response = error_response(ApiError(408, str(exc)))
                response.headers["Connection"] = "close"
                return response

    @app.after_request
    def count_answer(response):
        api = request_api()  # the route's family (g.api); the path's for unrouted requests
        client.metrics.answered(api, response.status_code)
        response.headers["X-Request-Id"] = g.get("request_id") or request_id(None)
        fields = {
            "request_id": response.headers["X-Request-Id"],
            "team_id": request.headers.get("X-Team-Id"),
            "method": request.method,
            "path": request.path,
            "api": api,
            "status": response.status_code,
            "client": request.headers.get("X-Forwarded-For", request.remote_addr),
        }
        started, environ = g.get("started", time.monotonic()), request.environ

        def write() -> None:  # when the response is closed: after the whole answer, an error or a disconnect
            session: Session | None = environ.get(SESSION_KEY)
            reservation: Reservation | None = environ.get(RESERVATION_KEY)
            if reservation is not None:  # the quota's reservation back, what the request cost counted
                cost = 0 if session is None else limits.cost(session.completion_tokens, session.prompt_tokens)
                reservation.settle(cost)
            outcome = {}
            if session is not None:
                outcome = {
                    "prompt_tokens": session.prompt_tokens,
                    "tokens_out": session.completion_tokens,
                    "ttft_ms": None
                    if session.first_token_at is None
                    else round((session.first_token_at - session.started) * 1000, 1),
                    "finish_reason": (session.finish_reason.value if session.finish_reason else "cancelled"),
                }
            access_log.write(**fields, **outcome, duration_ms=round((time.monotonic() - started) * 1000, 1))

        if not (request.path == "/health" and request.method in ("GET", "HEAD")):  # probes: not a line each
            response.call_on_close(write)
        return response

    serving = Serving(models, config, drain, estimate, limits)
    # /inference/completion and /inference/chat_completion (llama-stack) are fixed paths: they win over the
    # native API's /inference/<path:model>
    for blueprint in (
        llama_stack_blueprint,
        native_blueprint,
        health_blueprint,
        anthropic_blueprint,  # /v1/messages and /v1/responses beside the OpenAI blueprint's /v1/... (no path overlaps)
        responses_blueprint,
        openai_blueprint,
        embeddings_blueprint,
        tgi_blueprint,
        shared_blueprint,
    ):
        app.register_blueprint(blueprint(serving))
    return app
