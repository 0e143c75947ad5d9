"""Every dialect's request bodies, from the seeds and the clients' own request shapes, against the mock
backend served under a hub-style name (``org/tiny-model``): each route takes the ``/`` in the name."""

from __future__ import annotations

import json

import pytest
import requests
from servers import ServerProcess

HUB = "org/tiny-model"
SIX_STOPS = ["<human>:", "<bot>:", "<|prompt|>", "<|answer|>", "<|endoftext|>", "</s>"]  # h2oGPT's six


@pytest.fixture(scope="module")
def hub():
    server = ServerProcess(
        "--mock", "--mock-tokens-per-second", "400", "--rows", "4", "--max-waiting", "8", "--served-model-name", HUB
    )
    yield server
    server.stop()


def _text(r: requests.Response) -> str:
    return r.text


# (name, method, path, body, check of the answer); the mock echoes the prompt's last bytes
CASES = [
    (
        "native inference",
        "/inference/" + HUB,
        {"text": "abc", "max_tokens": 9, "stream": False, "repetition_penalty": 1.1, "presence_penalty": 0.5},
        lambda r: r.json()["text"] == "Echo: abc" and r.json()["completion_tokens"] == 9,
    ),
    (
        "native predictions",
        "/predictions/" + HUB,
        {"text": "hi", "max_tokens": 5, "stream": False},
        lambda r: r.json()["completion_tokens"] == 5,
    ),
    ("native stream", "/inference/" + HUB, {"text": "abc", "max_tokens": 9}, lambda r: r.text == "Echo: abc"),
    # the llama-stack boilerplate's request (003) and llama-stack-client 0.0.50's CompletionRequest shape
    (
        "llama-stack completion",
        "/inference/completion",
        {"model": HUB, "content": "abc", "sampling_params": {"strategy": "greedy", "max_tokens": 9}, "stream": False},
        lambda r: r.json() == {"content": "Echo: abc", "stop_reason": "out_of_tokens", "logprobs": None},
    ),
    (
        "llama-stack completion logprobs",
        "/inference/completion",
        {
            "model": HUB,
            "content": ["a", "bc"],
            "sampling_params": {"strategy": "top_k", "top_k": 1, "temperature": 0.5, "max_tokens": 3},
            "logprobs": {"top_k": 2},
        },
        lambda r: (
            r.json()["content"] == "Ech"
            and len(r.json()["logprobs"]) == 3
            and all("logprobs_by_token" in lp for lp in r.json()["logprobs"])
        ),
    ),
    (
        "llama-stack chat",
        "/inference/chat_completion",
        {
            "model": HUB,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "sampling_params": {"strategy": "top_p", "temperature": 0.7, "top_p": 0.9, "max_tokens": 4},
            "tool_choice": "auto",
            "tool_prompt_format": "json",
            "stream": False,
        },
        lambda r: (
            r.json()["completion_message"]["role"] == "assistant"
            and r.json()["completion_message"]["stop_reason"] == "out_of_tokens"
            and r.json()["completion_message"]["tool_calls"] == []
            and len(r.json()["completion_message"]["content"]) == 4
        ),
    ),
    # shortfin: the seed's curl (004), and shortfin_apps.llm.client's body
    (
        "shortfin seed",
        "/generate",
        {
            "text": "<|begin_of_text|>Name the capital of the United States.<|eot_id|>",
            "sampling_params": {"max_completion_tokens": 50},
        },
        lambda r: (
            r.json()["responses"][0]["prompt"].startswith("<|begin_of_text|>")
            and r.json()["responses"][0]["responses"][0]["text"].startswith("Echo: ")
        ),
    ),
    (
        "shortfin client",
        "/generate",
        {
            "text": "1 2 3 4 5 ",
            "sampling_params": {"max_completion_tokens": 8, "temperature": 0.7},
            "rid": "r1",
            "return_logprob": False,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "return_text_in_logprobs": False,
            "stream": False,
        },
        lambda r: r.json() == {"responses": [{"prompt": "1 2 3 4 5 ", "responses": [{"text": "Echo: 1 "}]}]},
    ),
    (
        "shortfin input_ids",
        "/generate",
        {
            "input_ids": [97, 98, 99],
            "sampling_params": {"max_completion_tokens": 3, "top_k": 1},
            "return_input_ids": True,
        },
        lambda r: r.json() == list(b"Ech"),
    ),
    # TGI: h2oGPT's curl (001) with its six stop sequences
    (
        "tgi h2ogpt",
        "/generate",
        {
            "inputs": "<|prompt|>What is Deep Learning?<|endoftext|><|answer|>",
            "parameters": {
                "max_new_tokens": 12,
                "truncate": 1024,
                "do_sample": True,
                "temperature": 0.1,
                "repetition_penalty": 1.2,
                "stop": SIX_STOPS,
            },
        },
        lambda r: isinstance(r.json()["generated_text"], str),
    ),
    # vLLM's OpenAI server as h2oGPT's vLLM mode and GuideLLM call it
    (
        "vllm completion",
        "/v1/completions",
        {
            "model": HUB,
            "prompt": "San Francisco is a",
            "max_tokens": 7,
            "temperature": 0,
            "stop": SIX_STOPS,
            "stop_token_ids": [0],
            "min_tokens": 2,
            "ignore_eos": True,
            "top_k": 5,
            "repetition_penalty": 1.0,
            "min_p": 0.05,
            "skip_special_tokens": True,
        },
        lambda r: r.json()["usage"]["completion_tokens"] == 7,
    ),
    # GuideLLM 0.8's openai_http bodies (request_handlers.py), as it sends them streaming
    (
        "guidellm completions",
        "/v1/completions",
        {
            "model": HUB,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 6,
            "stop": None,
            "ignore_eos": True,
            "prompt": "abc",
        },
        lambda r: r.text.endswith("data: [DONE]\n\n") and '"completion_tokens":6' in r.text,
    ),
    (
        "guidellm chat",
        "/v1/chat/completions",
        {
            "model": HUB,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": 6,
            "stop": None,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "abc"}],
        },
        lambda r: r.text.endswith("data: [DONE]\n\n") and '"completion_tokens":6' in r.text,
    ),
    (
        "openai chat",
        "/v1/chat/completions",
        {
            "model": HUB,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "min_tokens": 1,
            "top_k": 3,
        },
        lambda r: r.json()["choices"][0]["finish_reason"] == "length",
    ),
]


@pytest.mark.parametrize("name, path, body, check", CASES, ids=[c[0] for c in CASES])
def test_dialect_request_bodies(hub, name, path, body, check):
    r = requests.post(hub.url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert check(r), r.text


def test_hub_name_on_model_routes(hub):
    assert requests.get(f"{hub.url}/v1/models/{HUB}", timeout=10).json()["id"] == HUB
    assert requests.get(f"{hub.url}/info", timeout=10).json()["model_id"] == HUB
    r = requests.post(f"{hub.url}/inference/org/other", json={"text": "x"}, timeout=10)
    assert r.status_code == 404 and HUB in r.json()["message"]


def test_native_name_completion_is_llama_stack_not_a_model(hub):
    r = requests.post(hub.url + "/inference/completion", json={"text": "x"}, timeout=10)
    assert r.status_code == 400 and "detail" in r.json() and "'text'" in r.json()["detail"]


def test_llama_stack_streams_ndjson_and_sse(hub):
    body = {"model": HUB, "content": "abc", "sampling_params": {"max_tokens": 9}, "stream": True}
    with requests.post(hub.url + "/inference/completion", json=body, stream=True, timeout=30) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]  # the boilerplate's reader
    assert r.headers["Content-Type"].startswith("application/x-ndjson")
    assert "".join(c["delta"] for c in lines) == "Echo: abc" and lines[-1]["stop_reason"] == "out_of_tokens"
    chat = {
        "model": HUB,
        "messages": [{"role": "user", "content": "abc"}],
        "sampling_params": {"max_tokens": 4},
        "stream": True,
    }
    r = requests.post(
        hub.url + "/inference/chat_completion", json=chat, headers={"Accept": "text/event-stream"}, timeout=30
    )
    events = [json.loads(line[len("data: ") :])["event"] for line in r.text.split("\n\n") if line]
    assert [e["event_type"] for e in events][0] == "start" and events[-1]["event_type"] == "complete"
    assert len("".join(e["delta"] for e in events)) == 4 and events[-1]["stop_reason"] == "out_of_tokens"


def test_llama_stack_client(hub):
    """llama-stack-client 0.0.50, the last release that speaks the /inference/... paths of the seed's time."""
    llama_stack_client = pytest.importorskip("llama_stack_client")
    import httpx

    # 0.0.50 hands httpx a ``proxies`` argument that httpx 0.28 no longer takes: give it a client of our own
    client = llama_stack_client.LlamaStackClient(base_url=hub.url, max_retries=0, http_client=httpx.Client(timeout=30))
    done = client.inference.completion(
        model=HUB, content="abc", sampling_params={"strategy": "greedy", "max_tokens": 9}
    )
    assert done.content == "Echo: abc" and done.stop_reason == "out_of_tokens"
    chat = client.inference.chat_completion(
        model=HUB, messages=[{"role": "user", "content": "hi"}], sampling_params={"strategy": "greedy", "max_tokens": 4}
    )
    assert chat.completion_message.role == "assistant" and len(chat.completion_message.content) == 4
    chunks = list(
        client.inference.chat_completion(
            model=HUB,
            messages=[{"role": "user", "content": "hi"}],
            sampling_params={"strategy": "greedy", "max_tokens": 4},
            stream=True,
        )
    )
    assert "".join(c.event.delta for c in chunks) == chat.completion_message.content
    with pytest.raises(llama_stack_client.NotFoundError):
        client.inference.completion(model="nope", content="x")
    with pytest.raises(llama_stack_client.BadRequestError):
        client.inference.completion(model=HUB, content="x", sampling_params={"strategy": "beam"})


def test_shortfin_stream(hub):
    body = {"text": "abc", "sampling_params": {"max_completion_tokens": 9}, "rid": "req-7", "stream": True}
    r = requests.post(hub.url + "/generate", json=body, timeout=30)
    parts = r.text.split("\n\n")
    assert parts[-2:] == ["data: [DONE]", ""]
    assert all(p.startswith("data(req-7): ") for p in parts[:-2])
    assert "".join(p[len("data(req-7): ") :] for p in parts[:-2]) == "Echo: abc"


@pytest.mark.parametrize(
    "path, body, status, shape",
    [
        (
            "/generate",
            {"text": "x", "sampling_params": {"max_completion_tokens": 0}},
            400,
            lambda b: b["code"] == "INVALID_REQUEST_ARGS" and "max_completion_tokens" in b["error"],
        ),
        ("/generate", {"text": "x", "input_ids": [1]}, 400, lambda b: b["code"] == "INVALID_REQUEST_ARGS"),
        (
            "/generate",
            {"inputs": "x", "parameters": {"stop": SIX_STOPS + ["a", "b", "c"]}},
            422,
            lambda b: b["error_type"] == "validation" and "up to 8" in b["error"],
        ),
        (
            "/inference/chat_completion",
            {"model": HUB, "messages": [{"role": "tool", "content": "x"}]},
            400,
            lambda b: "ipython" in b["detail"],
        ),  # the role of a tool's result is ipython
        (
            "/v1/completions",
            {"model": HUB, "prompt": "x", "max_tokens": 2, "min_tokens": 3},
            400,
            lambda b: b["error"]["param"] == "min_tokens",
        ),
        (
            "/v1/completions",
            {"model": HUB, "prompt": "x", "stop_token_ids": [999]},
            400,
            lambda b: b["error"]["param"] == "stop_token_ids",
        ),
        (
            "/tokenize",
            {"prompt": "x" * 70000},
            400,
            lambda b: b["error"]["param"] == "prompt" and "at most" in b["error"]["message"],
        ),
        ("/tokenize", {"inputs": "x" * 70000}, 422, lambda b: "at most" in b["error"]),
        (
            "/v1/completions",
            {"model": HUB, "prompt": "x", "stop_token_ids": [1] * 1025},
            400,
            lambda b: b["error"]["param"] == "stop_token_ids" and "at most 1024" in b["error"]["message"],
        ),
        # the Responses API: OpenAI's shape
        (
            "/v1/responses",
            {"model": HUB, "input": "x", "tools": [{"type": "file_search"}]},
            400,
            lambda b: b["error"]["param"] == "tools[0]" and "built-in" in b["error"]["message"],
        ),
        ("/v1/responses", {"model": HUB}, 400, lambda b: b["error"]["param"] == "input"),
        (
            "/v1/responses",
            {"model": HUB, "input": "x", "previous_response_id": "resp_unknown"},
            404,
            lambda b: b["error"]["type"] == "not_found_error" and b["error"]["param"] == "previous_response_id",
        ),
        ("/v1/responses", {"model": "nope", "input": "x"}, 404, lambda b: b["error"]["code"] == "model_not_found"),
        # Anthropic's Messages: its own shape
        (
            "/v1/messages",
            {"model": HUB, "messages": [{"role": "user", "content": "x"}]},
            400,
            lambda b: (
                b["type"] == "error"
                and b["error"]["type"] == "invalid_request_error"
                and "max_tokens" in b["error"]["message"]
            ),
        ),
        (
            "/v1/messages",
            {"model": HUB, "max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}]},
            400,
            lambda b: b["error"]["type"] == "invalid_request_error" and "tool_use" in b["error"]["message"],
        ),
        (
            "/v1/messages",
            {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
            404,
            lambda b: b == {"type": "error", "error": {"type": "not_found_error", "message": b["error"]["message"]}},
        ),
        ("/v1/messages/count_tokens", {"model": HUB}, 400, lambda b: b["error"]["type"] == "invalid_request_error"),
        # a reasoning model's thought: each API's own fields for it, in its own shape
        (
            "/v1/chat/completions",
            {"model": HUB, "messages": [{"role": "user", "content": "x"}], "thinking_budget_tokens": "many"},
            400,
            lambda b: b["error"]["param"] == "thinking_budget_tokens",
        ),
        (
            "/v1/responses",
            {"model": HUB, "input": "x", "reasoning": "high"},
            400,
            lambda b: b["error"]["param"] == "reasoning",
        ),
        (
            "/v1/messages",
            {
                "model": HUB,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": 8},
            },
            400,
            lambda b: b["error"]["type"] == "invalid_request_error" and "less than max_tokens" in b["error"]["message"],
        ),
    ],
)
def test_errors_in_each_dialects_shape(hub, path, body, status, shape):
    r = requests.post(hub.url + path, json=body, timeout=10)
    assert r.status_code == status and shape(r.json()), r.text


def test_the_agent_apis_on_the_mock(hub):
    """The Responses and Messages routes through the same serving as every dialect (the mock's echo)."""
    r = requests.post(
        hub.url + "/v1/responses", json={"model": HUB, "input": "abc", "max_output_tokens": 9}, timeout=30
    )
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"].startswith("Echo: ")  # the chat prompt
    assert r.json()["status"] == "incomplete" and r.json()["usage"]["output_tokens"] == 9
    body = {"model": HUB, "max_tokens": 9, "messages": [{"role": "user", "content": "abc"}]}
    r = requests.post(hub.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and [b["type"] for b in r.json()["content"]] == ["text"]
    assert r.json()["content"][0]["text"].startswith("Echo: ")
    assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] == 9


def test_tokenize_counts_equal_usage(hub):
    usage = requests.post(
        hub.url + "/v1/completions", json={"model": HUB, "prompt": "héllo", "max_tokens": 1}, timeout=10
    ).json()["usage"]
    tok = requests.post(hub.url + "/tokenize", json={"model": HUB, "prompt": "héllo"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"] == 6 and tok["max_model_len"] == 2048
    messages = [{"role": "user", "content": "hi"}]
    chat_usage = requests.post(
        hub.url + "/v1/chat/completions", json={"model": HUB, "messages": messages, "max_tokens": 1}, timeout=10
    ).json()["usage"]
    assert (
        requests.post(hub.url + "/tokenize", json={"messages": messages}, timeout=10).json()["count"]
        == chat_usage["prompt_tokens"]
    )
    assert requests.post(hub.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json() == {
        "prompt": "héllo"
    }
    tgi = requests.post(hub.url + "/tokenize", json={"inputs": "hé"}, timeout=10).json()
    assert tgi == [
        {"id": 104, "text": "h", "start": 0, "stop": 1},
        {"id": 195, "text": "é", "start": 1, "stop": 2},
        {"id": 169, "text": "é", "start": 1, "stop": 2},
    ]


def test_continuous_usage_stats(hub):
    body = {
        "model": HUB,
        "prompt": "abc",
        "max_tokens": 5,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = requests.post(hub.url + "/v1/completions", json=body, timeout=30)
    chunks = [json.loads(e[len("data: ") :]) for e in r.text.strip().split("\n\n")[:-1]]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []
