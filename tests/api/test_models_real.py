"""Several models on one server, with real engines: the first model (a tiny llama) started with the server and
the GGUFs of a models folder (a tiny qwen2, a tiny llama at Q8_0, the tiny BERT, a broken file) each loaded when
a request names it, through the JWT proxy with the official openai client: the names and states in /v1/models,
the request's model answering, the first model's stream going on while another loads, the least recently used
idle model unloaded past --models-max, a broken file failing its own requests only, per-model metrics,
loading and unloading for operators alone, and the chat page in a real browser listing every model with its state
and loading one for a chat. The pool's decisions without processes: test_model_pool.py."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import openai
import pytest
import requests
from browser import open_playground, send, set_params, wait_answer_done
from gguf_reference import GGUF_DIR
from servers import MODEL_CACHE, ServerProcess, team_token, wait_for

FIRST = "llama-q4_k_m"
OTHERS = ("qwen2-q4_k_m", "llama-q8_0", "bert-q8_0")
BERT = json.loads((GGUF_DIR / "bert-llamacpp.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    for name in OTHERS:
        (folder / f"{name}.gguf").symlink_to(GGUF_DIR / f"{name}.gguf")
    (folder / "broken.gguf").write_bytes(b"GGUF but not really")
    with ServerProcess(
        "--model",
        str(GGUF_DIR / f"{FIRST}.gguf"),
        "--models-dir",
        str(folder),
        "--models-max",
        "3",
        "--model-cache-dir",
        MODEL_CACHE,
        "--context-length",
        "256",
        "--cache-ram",
        "0",
    ) as server:
        yield server


def states(server) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in requests.get(server.url + "/v1/models", timeout=10).json()["data"]}


def test_every_model_is_listed_with_its_state(client, server):
    ids = [m.id for m in client.models.list()]
    assert ids[0] == FIRST and sorted(ids[1:]) == sorted([*OTHERS, "broken"])
    assert states(server) == {FIRST: "loaded", **{n: "unloaded" for n in (*OTHERS, "broken")}}
    card = client.models.retrieve("qwen2-q4_k_m")
    assert card.id == "qwen2-q4_k_m" and card.status["value"] in ("unloaded", "loaded")  # type: ignore[attr-defined]


def test_a_request_loads_its_model_while_the_first_ones_stream_goes_on(client, server):
    """A request for qwen2 loads it (seconds: a new engine process); meanwhile a whole stream of the first model
    starts and ends (the tiny model's 40 tokens take milliseconds: so the load must not hold it)."""
    done: dict = {}

    def load_by_request() -> None:
        done["answer"] = client.chat.completions.create(
            model="qwen2-q4_k_m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        done["at"] = time.monotonic()

    thread = threading.Thread(target=load_by_request)
    thread.start()
    assert wait_for(lambda: states(server)["qwen2-q4_k_m"] == "loading", 60)
    stream = client.completions.create(
        model=FIRST,
        prompt="Once upon a time",
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    streamed, still = time.monotonic(), states(server)["qwen2-q4_k_m"]
    thread.join(120)
    answer = done["answer"]
    assert answer.model == "qwen2-q4_k_m" and answer.usage.completion_tokens == 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40 and len(chunks) > 3
    assert still == "loading" and streamed < done["at"]  # the first model's whole stream during the load
    alone = client.chat.completions.create(
        model="qwen2-q4_k_m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert alone.choices[0].message.content == answer.choices[0].message.content
    assert states(server)["qwen2-q4_k_m"] == "loaded"
    card = requests.get(server.url + "/v1/models/qwen2-q4_k_m", timeout=10).json()
    assert card["status"]["load_seconds"] > 0 and card["status"]["memory_bytes"] > 0


def test_an_embedding_model_of_the_folder_gives_llama_cpps_vectors(client):
    r = client.embeddings.create(model="bert-q8_0", input=BERT["texts"])
    ours = np.array([d.embedding for d in r.data])
    assert (ours * np.array(BERT["files"]["bert-q8_0.gguf"]["vectors"])).sum(1).min() > 0.999
    with pytest.raises(openai.BadRequestError, match="does not embed"):
        client.embeddings.create(model=FIRST, input="x")


def test_past_models_max_the_least_recently_used_idle_model_is_unloaded(client, server):
    for name in ("qwen2-q4_k_m", "bert-q8_0"):  # the folder's models loaded, qwen2 the earlier used
        requests.post(server.url + "/models/load", json={"model": name}, timeout=120).raise_for_status()
    time.sleep(0.01)
    client.embeddings.create(model="bert-q8_0", input="x")
    client.completions.create(model="llama-q8_0", prompt="a", max_tokens=2)
    assert states(server) == {
        FIRST: "loaded",
        "qwen2-q4_k_m": "unloaded",
        "llama-q8_0": "loaded",
        "bert-q8_0": "loaded",
        "broken": states(server)["broken"],
    }


def test_a_broken_file_fails_its_own_requests_only(client):
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="broken", prompt="a", max_tokens=2)
    assert err.value.status_code == 503 and "broken.gguf" in err.value.message
    assert client.completions.create(model=FIRST, prompt="a", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        client.completions.create(model="nope", prompt="a", max_tokens=2)


def test_metrics_per_model(server):
    text = requests.get(server.url + "/metrics", timeout=10).text
    generated = {
        line.split('model="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("inference_generated_tokens_total{")
    }
    assert generated[FIRST] >= 40 and generated["llama-q8_0"] == 2 and "qwen2-q4_k_m" not in generated  # unloaded
    assert 'inference_http_requests_total{api="openai",status="200"}' in text  # the app's own: unlabelled


def test_loading_and_unloading_are_for_operators(proxy, server):
    team = {"Authorization": f"Bearer {team_token()}"}
    admin = {"Authorization": f"Bearer {team_token(team_id='ops', admin=True)}"}
    for path in ("/models/unload", "/models/load"):
        r = requests.post(proxy.url + path, json={"model": "llama-q8_0"}, headers=team, timeout=30)
        assert r.status_code == 403 and "for operators" in r.text
    r = requests.post(proxy.url + "/models/unload", json={"model": "llama-q8_0"}, headers=admin, timeout=30)
    assert r.status_code == 200 and r.json()["status"]["value"] == "unloaded"
    r = requests.post(proxy.url + "/models/unload", json={"model": FIRST}, headers=admin, timeout=30)
    assert r.status_code == 409 and "first model stays loaded" in r.text
    r = requests.post(proxy.url + "/models/load", json={"model": "llama-q8_0"}, headers=admin, timeout=120)
    assert r.status_code == 200 and r.json()["status"]["value"] == "loaded"


@pytest.mark.timeout(180)
def test_the_chat_page_lists_every_model_and_a_chat_loads_one(context, proxy, server):
    """In chromium through the proxy: the page's model list is /v1/models' (a model not loaded marked with its
    state), and a chat with a model not loaded loads it and streams its answer."""
    context.set_default_timeout(120_000)  # (the chat waits for the model's load)
    page = open_playground(context, proxy.url, team_token())
    now = states(server)
    assert now["qwen2-q4_k_m"] == "unloaded" and now["broken"] != "loaded"
    options = page.locator("#model option")
    assert options.all_text_contents() == [name if s == "loaded" else f"{name} ({s})" for name, s in now.items()]
    assert [options.nth(i).get_attribute("value") for i in range(options.count())] == list(now)
    page.locator("#model").select_option("qwen2-q4_k_m")
    set_params(page, temperature="0", **{"max-tokens": "8"})
    send(page, "hi")
    note = wait_answer_done(page).text_content()
    assert note.startswith("Finished: length") and "8 completion tokens" in note, note
    assert page.locator("#messages .assistant .text").first.text_content()
    assert states(server)["qwen2-q4_k_m"] == "loaded"


def test_bench_times_a_switch_to_each_model(server):  # (last: it unloads each model of the folder)
    import re
    import subprocess
    import sys

    bench = GGUF_DIR.parents[2] / "scripts" / "bench.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--url", server.url, "--switch"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    for name in ("qwen2-q4_k_m", "llama-q8_0"):
        assert re.search(rf"{name}\s+first token after a switch\s+[\d.]+ ms = load\s+[\d.]+ ms", result.stdout), (
            result.stdout
        )
    assert re.search(r"bert-q8_0: no answer", result.stdout) and re.search(r"broken: no answer", result.stdout)
