"""GET /metrics: Prometheus counters for answers, tokens and endings, latency histograms, row gauges."""
from __future__ import annotations

import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from inference_api.error_shapes import api_of
from inference_api.messages import EngineStats, FinishReason
from inference_api.metrics import Metrics


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_api_labels_never_carry_the_raw_path():
    assert [api_of(p) for p in ("/v1/chat/completions", "/generate", "/", "/inference/m", "/predictions/x",
                                "/inference/completion", "/health", "/no/such/path")] == [
        "openai", "tgi", "tgi", "native", "native", "llama_stack", "other", "other"]
    assert api_of("/generate", {"text": "x"}) == "shortfin" and api_of("/generate", {"inputs": "x"}) == "tgi"
    assert api_of("/tokenize", {"prompt": "x"}) == "openai" and api_of("/tokenize", {"inputs": "x"}) == "tgi"


def test_counters_histograms_and_gauges():
    metrics = Metrics(lambda: EngineStats(rows_in_use=3, rows_total=32, waiting=5), lambda: 8)
    started = time.monotonic() - 0.2
    metrics.submitted(12)
    metrics.tokens(1, started)
    metrics.tokens(4)
    metrics.ended(FinishReason.LENGTH, started)
    metrics.answered("openai", 200)
    metrics.answered("native", 400)
    got = samples(metrics.exposition().decode())
    assert got[("inference_prompt_tokens_total", ())] == 12
    assert got[("inference_generated_tokens_total", ())] == 5
    assert got[("inference_generations_finished_total", (("reason", "length"),))] == 1
    assert got[("inference_time_to_first_token_seconds_count", ())] == 1
    assert got[("inference_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 0
    assert got[("inference_time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1
    assert got[("inference_request_duration_seconds_count", ())] == 1
    assert got[("inference_http_requests_total", (("api", "openai"), ("status", "200")))] == 1
    assert got[("inference_http_requests_total", (("api", "native"), ("status", "400")))] == 1
    assert (got[("inference_rows_in_use", ())], got[("inference_rows_total", ())], got[("inference_queue_length", ())],
            got[("inference_open_sessions", ())]) == (3, 32, 5, 8)


def test_server_metrics_follow_finished_bad_and_abandoned_requests(mock_server, model_name):
    def scrape() -> dict[tuple, float]:
        r = requests.get(mock_server.url + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
        return samples(r.text)

    mock_server.wait_idle()
    before = scrape()
    url = f"{mock_server.url}/inference/{model_name}"
    assert requests.post(url, json={"text": "abc", "max_tokens": 7, "stream": False}, timeout=30).status_code == 200
    assert requests.post(url, json={"text": "abc", "top_k": 0}, timeout=30).status_code == 400
    r = requests.post(url, json={"text": "abandon me", "max_tokens": 500}, stream=True, timeout=30)
    next(r.iter_content(chunk_size=None))
    r.close()
    mock_server.wait_idle(timeout=10)
    after = scrape()

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
