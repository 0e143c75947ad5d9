"""The proxy's own refusals (429 team limit) give each client the exception type the server's overload (503) gives."""

from __future__ import annotations

import httpx
import openai
import pytest
import requests
import text_generation
from proxy_helpers import bearer, make_token


@pytest.mark.timeout(120)
def test_team_limit_429_per_client(inference_server, make_proxy):
    proxy = make_proxy(inference_server.url, "--max-concurrent-per-team", "1")
    token = make_token()
    model = requests.get(inference_server.url + "/health", timeout=10).json()["model"]
    hold = requests.post(
        f"{proxy.url}/inference/{model}",
        json={"text": "hold", "max_tokens": 400},
        headers=bearer(token),
        stream=True,
        timeout=60,
    )
    try:
        assert hold.status_code == 200
        with pytest.raises(text_generation.errors.OverloadedError):  # as for the server's 503
            text_generation.Client(proxy.url, headers=bearer(token)).generate("hi", max_new_tokens=2)
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=proxy.url + "/v1", api_key=token, max_retries=0).completions.create(
                model=model, prompt="hi", max_tokens=2
            )
        llama_stack_client = pytest.importorskip("llama_stack_client")
        client = llama_stack_client.LlamaStackClient(
            base_url=proxy.url, max_retries=0, http_client=httpx.Client(headers=bearer(token))
        )
        with pytest.raises(llama_stack_client.RateLimitError):
            client.inference.completion(model=model, content="hi")
        shortfin = requests.post(proxy.url + "/generate", json={"text": "hi"}, headers=bearer(token), timeout=10)
        assert shortfin.status_code == 429 and shortfin.json()["code"] == "QUEUE_FULL"
    finally:
        hold.close()
