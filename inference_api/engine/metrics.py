"""Prometheus metrics for ``GET /metrics``: requests, tokens, latency, rows, KV cache, prefix cache and queue.

One registry per app (no process-wide default registry), fed from two places: the app's after-request
hook (every HTTP answer) and the engine client's demultiplexer (every generation event, and the engine's
stats after each step), so the hot path adds a few counter increments per event and nothing more. Gauges
read the latest stats when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .messages import EngineStats, FinishReason, step_rows_label

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1,
    2.5,
)  # a decode step, from a small model alone to a large one under load
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        open_sessions: Callable[[], int],
        ranks_alive: Callable[[], list[bool]] = list,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``clock``: the monotonic time the latencies are measured on (the same clock as the times passed in)."""
        self.clock = clock
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "inference_http_requests",
            "HTTP answers by API (never the raw path) and status",
            ["api", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("inference_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("inference_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter(
            "inference_generations_finished", "generations ended, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "inference_time_to_first_token_seconds",
            "from submission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "inference_time_per_output_token_seconds",
            "gap between a request's tokens, after its first: one observation per token",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "inference_request_duration_seconds",
            "from submission until the request is released",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_restarts = Counter(
            "inference_engine_restarts", "engine processes restarted after a crash", registry=r
        )
        self.prefix_queries = Counter(
            "inference_prefix_cache_queries", "prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "inference_prefix_cache_hits", "prompt tokens found in the prefix cache and reused", registry=r
        )
        self._prefix_totals = [0, 0]  # the two counters' values: queried, hit (for the hit rate)
        self.spec_drafted = Counter(
            "inference_spec_drafted_tokens", "tokens drafted for the model to check (speculative decoding)", registry=r
        )
        self.spec_accepted = Counter(
            "inference_spec_accepted_tokens", "drafted tokens the model confirmed (kept without a step)", registry=r
        )
        self._spec_totals = [0, 0]  # drafted, accepted (for the acceptance rate)
        gauges = {
            "inference_rows_in_use": ("user rows decoding or prefilling", lambda: stats().rows_in_use),
            "inference_rows_total": ("user rows", lambda: stats().rows_total),
            "inference_queue_length": ("requests waiting for a row", lambda: stats().waiting),
            "inference_open_sessions": ("sessions the app holds", open_sessions),
            "inference_kv_cache_tokens_in_use": (
                "KV cache positions held by the rows in use",
                lambda: stats().kv_tokens_in_use,
            ),
            "inference_kv_cache_capacity_tokens": (
                "KV cache positions of all user rows",
                lambda: stats().kv_tokens_total,
            ),
            "inference_kv_cache_usage_ratio": (
                "KV cache positions in use / all of them (0..1)",
                lambda: _kv_usage(stats()),
            ),
            "inference_prefix_cache_hit_rate": (
                "prompt tokens reused / looked up in the prefix cache, since the worker started",
                lambda: _ratio(self._prefix_totals[1], self._prefix_totals[0]),
            ),
            "inference_spec_acceptance_rate": (
                "drafted tokens confirmed / drafted (speculative decoding), since the worker started",
                lambda: _ratio(self._spec_totals[1], self._spec_totals[0]),
            ),
        }
        for name, (help_text, read) in gauges.items():
            Gauge(name, help_text, registry=r).set_function(read)
        r.register(_Ranks(ranks_alive))
        self.decode_steps = _DecodeSteps()
        r.register(self.decode_steps)

    def submitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, count: int, first_since: float | None = None, previous_at: float | None = None) -> float:
        """``count`` new tokens of one event, arrived at the (monotonic) time returned. ``first_since``: the
        submission time, when these are the request's first (time to first token); else ``previous_at``: when
        its previous tokens arrived (time per output token: each of these tokens is observed as an equal share of
        the gap). Tokens that come in the same event as the first have no gap of their own and are not observed."""
        now = self.clock()
        self.generated_tokens.inc(count)
        if count and first_since is not None:
            self.ttft.observe(now - first_since)
        elif count and previous_at is not None:
            share = (now - previous_at) / count
            for _ in range(count):
                self.tpot.observe(share)
        return now

    def engine_stats(self, previous: EngineStats, current: EngineStats) -> None:
        """Fold the engine's cumulative counters into this worker's: what they grew by since the previous stats.
        An engine restarted after a crash counts from zero again (the client resets its stats when the engine is
        lost, and a counter found lower than before counts as restarted), so the exposed counters never go down."""
        lower = current.prefix_queried_tokens < previous.prefix_queried_tokens
        if lower or sum(current.decode_steps) < sum(previous.decode_steps):  # a new engine, counting from zero
            previous = EngineStats()
        self.decode_steps.fold(previous, current)
        pairs = (
            (
                self.prefix_queries,
                previous.prefix_queried_tokens,
                current.prefix_queried_tokens,
                self._prefix_totals,
                0,
            ),
            (self.prefix_hits, previous.prefix_hit_tokens, current.prefix_hit_tokens, self._prefix_totals, 1),
            (self.spec_drafted, previous.spec_drafted_tokens, current.spec_drafted_tokens, self._spec_totals, 0),
            (self.spec_accepted, previous.spec_accepted_tokens, current.spec_accepted_tokens, self._spec_totals, 1),
        )
        for counter, before, now, totals, i in pairs:
            if now > before:
                counter.inc(now - before)
                totals[i] += now - before

    def ended(self, reason: FinishReason, started: float) -> None:
        """A request left the server: finished, failed, or abandoned by its client (cancelled)."""
        self.finished.labels(reason.value).inc()
        self.duration.observe(self.clock() - started)

    def answered(self, api: str, status: int) -> None:
        """An HTTP answer of an API family (``error_shapes``), never labelled with the raw path."""
        self.requests.labels(api, str(status)).inc()

    def watch(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A gauge read from elsewhere when scraped (e.g. the team limits' Redis fallbacks)."""
        Gauge(name, help_text, registry=self.registry).set_function(read)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def exposition_of(models: list[tuple[str, Metrics]]) -> bytes:
    """Several models' metrics in one exposition, each sample labelled with its ``model`` (one family per name:
    Prometheus takes a name once). The HTTP answers and what the app watches come from the first model's
    registry, where the app counts them, unlabelled."""
    if len(models) == 1:
        return models[0][1].exposition()
    families: dict[str, Metric] = {}
    for i, (name, metrics) in enumerate(models):
        for family in metrics.registry.collect():
            app_level = family.name in _APP_FAMILIES
            if app_level and i:
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = sample.labels if app_level else {**sample.labels, "model": name}
                merged.samples.append(sample._replace(labels=labels))

    class _Merged:
        def collect(self):
            yield from families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


_APP_FAMILIES = frozenset({"inference_http_requests", "inference_quota_redis_fallbacks"})  # counted by the app


class _Ranks:
    """``inference_engine_rank_up{rank}``: 1 for each engine process alive (rank 0, the engine process, and with
    --tensor-parallel-size N the ranks 1..N-1 it started), read when scraped; no samples before the engine is ready."""

    def __init__(self, ranks_alive: Callable[[], list[bool]]):
        self.ranks_alive = ranks_alive

    def collect(self):
        family = GaugeMetricFamily(
            "inference_engine_rank_up", "engine rank processes alive (1) or ended (0)", labels=["rank"]
        )
        for rank, alive in enumerate(self.ranks_alive()):
            family.add_metric([str(rank)], 1.0 if alive else 0.0)
        yield family


class _DecodeSteps:
    """``inference_engine_decode_step_seconds{rows}``: a summary (count and sum) of the engine's decode steps, the
    steps that computed no prompt chunk, by how many rows they decoded (1, 2, 3-4, 5-8, ...): its mean is the step
    time per row count. Folded from the engine's cumulative books as the prefix counters are; never goes down."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.seconds: list[float] = []

    def fold(self, previous: EngineStats, current: EngineStats) -> None:
        grow = len(current.decode_steps) - len(self.steps)
        if grow > 0:
            self.steps += [0] * grow
            self.seconds += [0.0] * grow
        for b, (steps, seconds) in enumerate(zip(current.decode_steps, current.decode_seconds)):
            before = b < len(previous.decode_steps)
            self.steps[b] += steps - (previous.decode_steps[b] if before else 0)
            self.seconds[b] += seconds - (previous.decode_seconds[b] if before else 0.0)

    def collect(self):
        family = SummaryMetricFamily(
            "inference_engine_decode_step_seconds",
            "engine steps that decoded rows and computed no prompt chunk, by rows decoded: count and seconds",
            labels=["rows"],
        )
        for b, (steps, seconds) in enumerate(zip(self.steps, self.seconds)):
            if steps:
                family.add_metric([step_rows_label(b)], count_value=steps, sum_value=seconds)
        yield family


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _kv_usage(stats: EngineStats) -> float:
    return _ratio(stats.kv_tokens_in_use, stats.kv_tokens_total)
