"""Speculative decoding and the prompt cache beyond the rows through HTTP: on the real model (the shared default
server, where speculation is on), an answer that copies its input comes back the same with speculation on and
with the request's ``speculative: false``, and /metrics counts the drafts; on mock servers with one row, a
conversation whose row another took is restored from the prompt cache (``cached_tokens``), and with
``--prompt-cache-dir`` after a restart too."""

from __future__ import annotations

import re
import sys

import requests
from servers import Process, ServerProcess, free_port, wait_for

CODE = '''def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop sequence."""
    longest = 0
    for stop in stops:
        window = text[-(len(stop) - 1) :] if len(stop) > 1 else ""
        i = window.find(stop[0]) if window else -1
        while i != -1 and len(window) - i > longest:
            if stop.startswith(window[i:]):
                longest = len(window) - i
                break
            i = window.find(stop[0], i + 1)
    return longest
'''


def spec_counts(url: str) -> tuple[float, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    found = dict(re.findall(r"^inference_spec_(drafted|accepted)_tokens_total (\S+)$", text, re.M))
    return float(found.get("drafted", 0)), float(found.get("accepted", 0))


def test_a_copying_answer_is_the_same_with_and_without_speculation(default_server, model_name):
    ask = f"Repeat this code exactly, with held_back renamed to held_suffix:\n\n{CODE}"
    body = {"model": model_name, "messages": [{"role": "user", "content": ask}], "max_tokens": 120, "temperature": 0}
    url = default_server.url
    before = spec_counts(url)
    on = requests.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    drafted, accepted = (a - b for a, b in zip(spec_counts(url), before))
    off = requests.post(url + "/v1/chat/completions", json={**body, "speculative": False}, timeout=300).json()
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    assert on["usage"]["completion_tokens"] == off["usage"]["completion_tokens"] > 40
    assert drafted > 0 and accepted > 0  # the row drafted, and the model kept some of it
    assert spec_counts(url)[0] == before[0] + drafted  # (the request that opted out drafted nothing)


STORY = "The lighthouse keeper wrote down every ship that passed the reef. " * 12


def ask(url: str, model: str, text: str) -> dict:
    body = {"model": model, "prompt": text, "max_tokens": 4, "temperature": 0}
    r = requests.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_conversation_whose_row_was_taken_is_restored_and_survives_a_restart(tmp_path, model_name):
    flags = ["--mock", "--mock-tokens-per-second", "0", "--rows", "1", "--prompt-cache-dir", str(tmp_path)]
    with ServerProcess(*flags) as server:
        first = ask(server.url, model_name, STORY)
        ask(server.url, model_name, "Something else entirely, long enough to be kept too. " * 4)  # takes the row
        again = ask(server.url, model_name, STORY + "And then?")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(STORY.encode()) - 1
        assert first["choices"][0]["text"]  # (the mock echoes what its row holds: a wrong restore shows)
    assert list(tmp_path.glob("*.kvc"))  # written beside memory, and the rows' caches at shutdown
    with ServerProcess(*flags) as server:
        after = ask(server.url, model_name, STORY + "And then?")
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(STORY.encode()) - 1
        assert after["choices"][0]["text"] == again["choices"][0]["text"]


def test_a_draft_model_of_the_same_vocabulary_drafts_and_the_answer_is_the_same():
    """--draft-model: the tiny llama's Q8_0 file drafts for its Q4_K_M file (tests/data/gguf: one vocabulary);
    a draft of another vocabulary (qwen3think's) stops the start with the reason."""
    from gguf_reference import GGUF_DIR

    target, draft = GGUF_DIR / "llama-q4_k_m.gguf", GGUF_DIR / "llama-q8_0.gguf"
    with ServerProcess("--model", str(target), "--draft-model", str(draft), "--rows", "4") as server:
        body = {"model": "llama-q4_k_m", "prompt": "The history of the town", "max_tokens": 60, "temperature": 0}
        on = requests.post(server.url + "/v1/completions", json=body, timeout=120).json()
        off = requests.post(server.url + "/v1/completions", json={**body, "speculative": False}, timeout=120).json()
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        # (a draft model as large as the model pays only while its costs are not yet measured: a few drafts;
        # tests/engine/test_speculative.py drafts with it on fixed costs)
        assert spec_counts(server.url)[0] >= 1
    other = GGUF_DIR / "qwen3think-q4_k_m.gguf"
    port = free_port()
    argv = [sys.executable, "-m", "inference_api", "--port", str(port), "--model", str(target)]
    with Process([*argv, "--draft-model", str(other)], port, env={"SKIP_PREFLIGHT": "1"}) as server:
        assert wait_for(lambda: "its vocabulary is not the model's" in server.output(), 120)
        assert requests.get(server.url + "/health", timeout=10).status_code == 503
