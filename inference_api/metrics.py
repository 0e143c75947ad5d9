"""Prometheus metrics for ``GET /metrics``: requests, tokens, latency, rows and queue.

One registry per app (no process-wide default registry), fed from two places: the app's after-request
hook (every HTTP answer) and the engine client's demultiplexer (every generation event), so the hot
path adds a counter increment per event and nothing more.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .messages import EngineStats, FinishReason

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], open_sessions: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("inference_http_requests", "HTTP answers by API (never the raw path) and status",
                                ["api", "status"], registry=r)
        self.prompt_tokens = Counter("inference_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("inference_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("inference_generations_finished", "generations ended, by reason", ["reason"],
                                registry=r)
        self.ttft = Histogram("inference_time_to_first_token_seconds", "from submission to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("inference_request_duration_seconds",
                                  "from submission until the request is released", buckets=_LATENCY_BUCKETS, registry=r)
        self.engine_restarts = Counter("inference_engine_restarts", "engine processes restarted after a crash",
                                       registry=r)
        gauges = {"inference_rows_in_use": ("user rows decoding or prefilling", lambda: stats().rows_in_use),
                  "inference_rows_total": ("user rows", lambda: stats().rows_total),
                  "inference_queue_length": ("requests waiting for a row", lambda: stats().waiting),
                  "inference_open_sessions": ("sessions the app holds", open_sessions)}
        for name, (help_text, read) in gauges.items():
            Gauge(name, help_text, registry=r).set_function(read)

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, count: int, first_since: float | None = None) -> None:
        """``count`` new tokens; ``first_since``: the submission time, when these are the request's first."""
        self.generated_tokens.inc(count)
        if count and first_since is not None:
            self.ttft.observe(time.monotonic() - first_since)

    def ended(self, reason: FinishReason, started: float) -> None:
        """A request left the server: finished, failed, or abandoned by its client (cancelled)."""
        self.finished.labels(reason.value).inc()
        self.duration.observe(time.monotonic() - started)

    def answered(self, api: str, status: int) -> None:
        """An HTTP answer of an API family (``error_shapes``), never labelled with the raw path."""
        self.requests.labels(api, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
