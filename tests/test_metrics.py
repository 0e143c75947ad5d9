"""GET /metrics: Prometheus counters for answers, tokens, endings and the prefix cache, latency histograms, row and
KV cache gauges."""

from __future__ import annotations

import requests
from prometheus_client.parser import text_string_to_metric_families
from servers import native

from inference_api.engine.messages import EngineStats, FinishReason, step_rows_bucket, step_rows_label
from inference_api.engine.metrics import Metrics
from lifecycle.error_shapes import api_of


def samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_api_labels_never_carry_the_raw_path():
    assert [
        api_of(p)
        for p in (
            "/v1/chat/completions",
            "/generate",
            "/",
            "/inference/m",
            "/predictions/x",
            "/inference/completion",
            "/health",
            "/no/such/path",
        )
    ] == ["openai", "tgi", "tgi", "native", "native", "llama_stack", "other", "other"]
    assert api_of("/generate", {"text": "x"}) == "shortfin" and api_of("/generate", {"inputs": "x"}) == "tgi"
    assert api_of("/tokenize", {"prompt": "x"}) == "openai" and api_of("/tokenize", {"inputs": "x"}) == "tgi"


class FakeClock:
    """A monotonic clock the test moves by hand (by steps that binary floats hold exactly)."""

    def __init__(self) -> None:
        self.now = 1024.0

    def __call__(self) -> float:
        return self.now


def test_counters_histograms_and_gauges():
    stats = EngineStats(rows_in_use=3, rows_total=32, waiting=5, kv_tokens_in_use=512, kv_tokens_total=32 * 2048)
    clock = FakeClock()
    metrics = Metrics(lambda: stats, lambda: 8, clock=clock)
    started = clock.now
    metrics.submitted(12)
    clock.now += 0.1875
    first = metrics.tokens(1, started)  # the first token 187.5 ms after submission
    assert first == clock.now
    clock.now += 0.015625
    metrics.tokens(4, previous_at=first)  # 4 tokens in one event, 15.6 ms after the first: 3.9 ms each
    metrics.tokens(2)  # an abandoned session's: counted, never timed
    clock.now += 0.796875
    metrics.ended(FinishReason.LENGTH, started)  # a second after submission
    metrics.answered("openai", 200)
    metrics.answered("native", 400)
    got = samples(metrics.exposition().decode())
    assert got[("inference_prompt_tokens_total", ())] == 12
    assert got[("inference_generated_tokens_total", ())] == 7
    assert got[("inference_time_per_output_token_seconds_count", ())] == 4
    assert got[("inference_time_per_output_token_seconds_sum", ())] == 0.015625
    assert got[("inference_time_per_output_token_seconds_bucket", (("le", "0.0025"),))] == 0
    assert got[("inference_time_per_output_token_seconds_bucket", (("le", "0.005"),))] == 4
    assert got[("inference_generations_finished_total", (("reason", "length"),))] == 1
    assert got[("inference_time_to_first_token_seconds_count", ())] == 1
    assert got[("inference_time_to_first_token_seconds_sum", ())] == 0.1875
    assert got[("inference_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[("inference_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("inference_request_duration_seconds_count", ())] == 1
    assert got[("inference_request_duration_seconds_sum", ())] == 1.0
    assert got[("inference_request_duration_seconds_bucket", (("le", "0.5"),))] == 0
    assert got[("inference_request_duration_seconds_bucket", (("le", "1.0"),))] == 1
    assert got[("inference_http_requests_total", (("api", "openai"), ("status", "200")))] == 1
    assert got[("inference_http_requests_total", (("api", "native"), ("status", "400")))] == 1
    assert (
        got[("inference_rows_in_use", ())],
        got[("inference_rows_total", ())],
        got[("inference_queue_length", ())],
        got[("inference_open_sessions", ())],
    ) == (3, 32, 5, 8)
    assert (
        got[("inference_kv_cache_tokens_in_use", ())],
        got[("inference_kv_cache_capacity_tokens", ())],
        got[("inference_kv_cache_usage_ratio", ())],
    ) == (512, 65536, 512 / 65536)
    assert got[("inference_prefix_cache_hit_rate", ())] == 0  # nothing looked up yet


def test_engine_counters_fold_into_counters_that_never_go_down_across_engine_restarts():
    metrics = Metrics(EngineStats, lambda: 0)

    def fold(*steps: tuple[int, int]) -> tuple[float, float, float]:
        previous = EngineStats()
        for queried, hit in steps:
            current = EngineStats(prefix_queried_tokens=queried, prefix_hit_tokens=hit)
            metrics.engine_stats(previous, current)
            previous = current
        got = samples(metrics.exposition().decode())
        return (
            got[("inference_prefix_cache_queries_total", ())],
            got[("inference_prefix_cache_hits_total", ())],
            got[("inference_prefix_cache_hit_rate", ())],
        )

    assert fold((10, 0), (10, 0), (30, 15)) == (30, 15, 0.5)
    # the client resets its stats when an engine is lost: the next engine's counts add from zero
    assert fold((20, 5)) == (50, 20, 0.4)
    # stats that went down without that reset are a new engine's too: added as they are, never subtracted
    metrics.engine_stats(
        EngineStats(prefix_queried_tokens=100, prefix_hit_tokens=90),
        EngineStats(prefix_queried_tokens=10, prefix_hit_tokens=10),
    )
    assert fold() == (60, 30, 0.5)


def test_decode_steps_by_rows_fold_across_engine_restarts():
    """The engine's cumulative decode steps and seconds by rows decoded: exposed as one summary per row count,
    what a restarted engine counts from zero added on."""
    assert [step_rows_label(step_rows_bucket(n)) for n in (1, 2, 3, 4, 5, 8, 9, 32)] == [
        "1",
        "2",
        "3-4",
        "3-4",
        "5-8",
        "5-8",
        "9-16",
        "17-32",
    ]
    metrics = Metrics(EngineStats, lambda: 0)
    first = EngineStats(decode_steps=(4, 0, 2), decode_seconds=(0.4, 0.0, 0.5))
    metrics.engine_stats(EngineStats(), first)
    later = EngineStats(decode_steps=(5, 0, 6), decode_seconds=(0.5, 0.0, 1.5))
    metrics.engine_stats(first, later)
    metrics.engine_stats(later, EngineStats(decode_steps=(1, 1), decode_seconds=(0.25, 0.5)))  # a new engine
    got = samples(metrics.exposition().decode())

    def summary(rows: str) -> tuple[float, float]:
        key = (("rows", rows),)
        return got[("inference_engine_decode_step_seconds_count", key)], got[
            ("inference_engine_decode_step_seconds_sum", key)
        ]

    assert summary("1") == (6, 0.75) and summary("2") == (1, 0.5) and summary("3-4") == (6, 1.5)


def scrape(server) -> dict[tuple, float]:
    r = requests.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
    return samples(r.text)


def never_decrease(earlier: dict[tuple, float], later: dict[tuple, float]) -> None:
    """Every counter and histogram series of ``earlier`` is at least as high in ``later``."""
    for key, value in earlier.items():
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert later[key] >= value, key


def test_server_metrics_follow_finished_bad_and_abandoned_requests(mock_server, model_name):
    mock_server.wait_idle()
    before = scrape(mock_server)
    assert native(mock_server, model_name, {"text": "abc", "max_tokens": 7, "stream": False}).status_code == 200
    assert native(mock_server, model_name, {"text": "abc", "top_k": 0}).status_code == 400
    r = native(mock_server, model_name, {"text": "abandon me", "max_tokens": 500}, stream=True)
    next(r.iter_content(chunk_size=None))
    r.close()
    mock_server.wait_idle(timeout=10)
    after = scrape(mock_server)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("inference_http_requests_total", api="native", status="200") == 2
    assert delta("inference_http_requests_total", api="native", status="400") == 1
    assert delta("inference_generations_finished_total", reason="length") == 1
    assert delta("inference_generations_finished_total", reason="cancelled") == 1
    assert delta("inference_prompt_tokens_total") == len("abc") + len("abandon me")
    assert delta("inference_generated_tokens_total") >= 7 + 1
    assert delta("inference_time_to_first_token_seconds_count") == 2
    assert delta("inference_request_duration_seconds_count") == 2
    assert after[("inference_open_sessions", ())] == 0 and after[("inference_rows_total", ())] == 4


def test_server_times_each_token_and_reports_kv_cache_and_prefix_cache_use(mock_server, model_name):
    mock_server.wait_idle()
    scrapes = [scrape(mock_server)]

    def grown(name: str) -> float:
        return scrapes[-1].get((name, ()), 0) - scrapes[-2].get((name, ()), 0)

    # streamed: "Echo: abc — " is 14 tokens, one event each but the dash's 3 bytes, which arrive together
    r = native(mock_server, model_name, {"text": "abc", "max_tokens": 14}, stream=True)
    assert r.status_code == 200 and r.text == "Echo: abc — "
    scrapes.append(scrape(mock_server))
    assert grown("inference_generated_tokens_total") == 14 and grown("inference_prompt_tokens_total") == 3
    assert grown("inference_time_to_first_token_seconds_count") == 1
    assert grown("inference_time_per_output_token_seconds_count") == 14 - 1
    assert grown("inference_time_per_output_token_seconds_sum") > 0
    assert grown("inference_prefix_cache_queries_total") == 3
    # the first token came with the prompt's step; each of the other 13 from a step that decoded that one row
    one_row = (("rows", "1"),)
    steps = scrapes[-1][("inference_engine_decode_step_seconds_count", one_row)] - scrapes[-2].get(
        ("inference_engine_decode_step_seconds_count", one_row), 0
    )
    assert steps == 13 and scrapes[-1][("inference_engine_decode_step_seconds_sum", one_row)] > 0

    # the same prompt again: all of it but its last token (always computed, for the first token's logits) reused
    r = native(mock_server, model_name, {"text": "abc", "max_tokens": 4, "stream": False})
    assert r.status_code == 200
    scrapes.append(scrape(mock_server))
    assert grown("inference_prefix_cache_queries_total") == 3 and grown("inference_prefix_cache_hits_total") == 2
    assert 0 < scrapes[-1][("inference_prefix_cache_hit_rate", ())] <= 1

    # while a request runs its row holds at least its prompt's positions
    prompt = "how full is the cache?"
    r = native(mock_server, model_name, {"text": prompt, "max_tokens": 1000}, stream=True)
    next(r.iter_content(chunk_size=None))
    scrapes.append(scrape(mock_server))
    r.close()
    in_use = scrapes[-1][("inference_kv_cache_tokens_in_use", ())]
    capacity = scrapes[-1][("inference_kv_cache_capacity_tokens", ())]
    assert capacity == 4 * 2048 and len(prompt) <= in_use <= capacity  # the mock server: 4 rows of 2048 positions
    assert 0 < scrapes[-1][("inference_kv_cache_usage_ratio", ())] <= 1
    mock_server.wait_idle(timeout=10)
    scrapes.append(scrape(mock_server))
    assert scrapes[-1][("inference_kv_cache_tokens_in_use", ())] == 0
    assert scrapes[-1][("inference_kv_cache_usage_ratio", ())] == 0
    for earlier, later in zip(scrapes, scrapes[1:]):
        never_decrease(earlier, later)
