"""The offline Python API over the mock backend: handle life cycle, statuses, stop/release/sync, timeouts, many
handles, generate order, and one validation with the HTTP API."""

from __future__ import annotations

import itertools

import pytest
import requests
from servers import ROOT, wait_for

from inference_api import LLM, EngineError, ParameterError, RequestStatus, SamplingParams

ROWS = 2


@pytest.fixture(scope="module")
def llm():
    # a small prefill chunk makes a long prompt's prefill last many (mock) steps, so it can be watched
    with LLM(mock=True, rows=ROWS, max_waiting=30, mock_tokens_per_second=100, prefill_chunk=8) as llm:
        yield llm


FAST = 0.002  # the poll of a state the engine passes through in a few (mock) steps, not to miss it


def read_all(handle, timeout: float = 30.0) -> str:
    pieces = []
    while (out := handle.queue.get(timeout=timeout)) is not None:
        pieces.append(out.text)
    return "".join(pieces)


def echo(prompt: str, tokens: int) -> str:
    """The mock's greedy answer: the echo cut at a token count (its tokens are bytes; a cut character is held)."""
    return (f"Echo: {prompt} — " * 4).encode()[:tokens].decode(errors="ignore")


def idle(llm) -> bool:
    return llm._client.stats.rows_in_use == 0 and llm._client.open_sessions == 0


def test_every_status_stop_sync_and_release(llm):
    assert wait_for(lambda: idle(llm))
    params = SamplingParams(max_tokens=2000, temperature=0)
    first = llm.start_request("a", params)
    assert first.status in (RequestStatus.WAITING, RequestStatus.PREFILLING, RequestStatus.GENERATING)
    assert wait_for(lambda: first.status is RequestStatus.GENERATING, interval=FAST)
    # 100 prefill steps, then 1,000 tokens: still generating when it is synced and released below, however slow
    # the machine (it is released long before it could end)
    long_prompt = llm.start_request("x" * 800, SamplingParams(max_tokens=1000, temperature=0))
    queued = llm.start_request("q", SamplingParams(max_tokens=12, temperature=0))
    assert wait_for(lambda: long_prompt.status is RequestStatus.PREFILLING, interval=FAST)
    assert queued.status is RequestStatus.WAITING  # both rows are taken
    assert queued.queue.get(timeout=0.2) is None and queued.queue.get_nowait() is None  # nothing yet: timeouts
    assert wait_for(lambda: long_prompt.status is RequestStatus.GENERATING, interval=FAST)

    # stop: the output so far stays readable, then the queue ends; the row goes to the waiting request
    got = first.queue.get(timeout=5)
    assert got.text and got.finish_reason is None and got.completion_tokens >= 1
    assert llm.stop_request(first) is RequestStatus.INTERRUPTED
    assert first.finish_reason == "cancelled"
    rest = read_all(first)
    assert (got.text + rest).startswith("Echo: a")
    assert first.queue.get(timeout=0.1) is None  # ended: never blocks
    assert wait_for(lambda: queued.status in (RequestStatus.PREFILLING, RequestStatus.GENERATING), interval=FAST)

    # sync: a timeout returns the current status; without one it waits for the end, keeping the output queued
    assert llm.sync_request(long_prompt, timeout=0.05) is RequestStatus.GENERATING
    assert llm.sync_request(queued) is RequestStatus.FINISHED
    assert queued.finish_reason == "length" and queued.queue.generated_length == 12
    assert read_all(queued) == "Echo: q — "  # 12 tokens: the mock's tokens are bytes, "—" is three

    # release a running request: its row is freed and its unread output dropped
    assert long_prompt.status is RequestStatus.GENERATING
    llm.release_request(long_prompt)
    assert long_prompt.status is RequestStatus.INTERRUPTED and long_prompt.queue.get(timeout=0.1) is None
    assert wait_for(lambda: idle(llm))


def test_outputs_carry_tokens_text_counts_and_logprobs(llm):
    handle = llm.start_request([104, 105], SamplingParams(max_tokens=8, temperature=0, logprobs=2))  # "hi"
    assert handle.prompt_token_ids == (104, 105)
    outs = []
    while (out := handle.queue.get(timeout=10)) is not None:
        outs.append(out)
    tokens = [t for o in outs for t in o.token_ids]
    logprobs = [lp for o in outs for lp in o.logprobs]
    assert bytes(tokens).decode() == "".join(o.text for o in outs) == "Echo: hi"
    # each output counts the tokens so far (one a get at 100 tokens/s, or several that arrived while the reader was
    # held up: a get takes all that has arrived)
    counts = [o.completion_tokens for o in outs]
    assert counts == list(itertools.accumulate(len(o.token_ids) for o in outs)) and counts[-1] == 8, counts
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    assert len(logprobs) == 8 and all(len(lp.top) == 2 and lp.top[0][0] == lp.token for lp in logprobs)
    assert handle.queue.prompt_tokens == 2
    plain = llm.start_request("hi", SamplingParams(max_tokens=3))
    assert llm.sync_request(plain) is RequestStatus.FINISHED and plain.queue.get_nowait().logprobs is None


def test_many_handles_beyond_the_rows_each_get_their_own_text(llm):
    assert wait_for(lambda: idle(llm))
    holders = [llm.start_request("hold", SamplingParams(max_tokens=2000)) for _ in range(ROWS)]
    assert wait_for(lambda: all(h.status is RequestStatus.GENERATING for h in holders), interval=FAST)
    handles = [
        llm.start_request(f"p{i:02d}", SamplingParams(max_tokens=9 + i % 3, temperature=0)) for i in range(24)
    ]  # 12 times the rows, every row held: all wait
    assert all(h.status is RequestStatus.WAITING for h in handles)
    for holder in holders:
        llm.release_request(holder)
    for i, h in enumerate(reversed(handles)):  # read in another order than they run
        i = 23 - i
        assert read_all(h) == echo(f"p{i:02d}", 9 + i % 3) and h.status is RequestStatus.FINISHED
    assert wait_for(lambda: idle(llm))


def test_queue_bound_is_a_clear_error(llm):
    assert wait_for(lambda: idle(llm))
    limit = llm.config.max_open_sessions
    handles = [llm.start_request("b", SamplingParams(max_tokens=500)) for _ in range(limit)]
    with pytest.raises(EngineError, match="busy"):
        llm.start_request("one too many")
    for h in handles:
        llm.release_request(h)
    assert wait_for(lambda: idle(llm))
    assert llm.generate(["after"], SamplingParams(max_tokens=5), use_tqdm=False)[0].text == "Echo:"


def test_generate_keeps_input_order_over_an_iterable(llm, capsys):
    assert wait_for(lambda: idle(llm))
    lengths = [30, 3, 17, 6, 25, 9, 12, 4, 20, 7]  # finish out of order
    prompts = (f"n{i}" for i in range(len(lengths)))  # a generator: read lazily
    results = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0) for n in lengths], use_tqdm=False)
    assert [r.index for r in results] == list(range(len(lengths)))
    for i, (r, n) in enumerate(zip(results, lengths)):
        assert r.text == echo(f"n{i}", n) and r.completion_tokens == n and r.finish_reason == "length"
    assert capsys.readouterr().err == ""  # use_tqdm=False: no bar

    results = llm.generate([f"m{i}" for i in range(6)], SamplingParams(max_tokens=8))
    assert [r.text for r in results] == [f"Echo: m{i}" for i in range(6)]
    bar = capsys.readouterr().err
    assert "6/6" in bar and "tok/s" in bar  # finished/total and the token rate

    chats = llm.chat(
        [[{"role": "user", "content": f"c{i}"}] for i in range(3)], SamplingParams(max_tokens=20), use_tqdm=False
    )
    assert [r.text for r in chats] == [echo(f"<|user|>c{i}\n<|assistant|>", 20) for i in range(3)]  # the template
    # one conversation, not a list of them (a few tokens: the default runs to the context's end, 10 s on the mock)
    one = llm.chat([{"role": "user", "content": "one"}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_tokens == len("<|user|>one\n<|assistant|>")


@pytest.mark.parametrize(
    "params,field,http_body",
    [
        (dict(temperature=5), "temperature", {"temperature": 5}),
        (dict(top_p=1.5), "top_p", {"top_p": 1.5}),
        (dict(max_tokens=0), "max_tokens", {"max_tokens": 0}),
        (dict(stop=list("abcdefghi")), "stop", {"stop": list("abcdefghi")}),  # over the default 8 stop sequences
        (dict(logprobs=9), "logprobs", {"logprobs": 9}),
        (dict(top_k="many"), "top_k", {"top_k": "many"}),
        (dict(n=9), "n", {"n": 9}),  # over the cap of 8 choices
    ],
)
def test_bad_parameters_fail_as_the_http_api_does(mock_server, params, field, http_body):
    with pytest.raises(ParameterError) as err:
        SamplingParams(**params)
    assert err.value.field == field
    r = requests.post(
        f"{mock_server.url}/v1/completions",
        timeout=30,
        json={"model": mock_server.health()["model"], "prompt": "x", **http_body},
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == str(err.value)  # one validation


def test_n_choices_offline(llm):
    """One request, n choices: generate gives each in outputs (choice 0's also as the result's own fields), a
    handle's queue gives each get one choice's output (Output.index)."""
    [result] = llm.generate(["fork"], SamplingParams(temperature=0, max_tokens=6, n=3), use_tqdm=False)
    assert [c.index for c in result.outputs] == [0, 1, 2]
    assert {c.text for c in result.outputs} == {result.text} == {echo("fork", 6)}  # greedy: equal choices
    assert all(c.finish_reason == "length" and c.completion_tokens == 6 for c in result.outputs)
    assert result.completion_tokens == 18 and result.finish_reason == "length"
    handle = llm.start_request("fork", SamplingParams(temperature=0, max_tokens=6, n=2))
    texts = {0: "", 1: ""}
    while (out := handle.queue.get(timeout=30)) is not None:
        texts[out.index] += out.text
    assert texts == {0: echo("fork", 6), 1: echo("fork", 6)} and handle.finish_reason == "length"
    [single] = llm.generate(["fork"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(single.outputs) == 1 and single.outputs[0].text == single.text


def test_generate_waits_for_as_many_places_as_a_request_has_choices():
    with LLM(mock=True, rows=2, max_waiting=1, mock_tokens_per_second=0) as small:  # 3 places
        results = small.generate(
            [f"p{i}" for i in range(4)], SamplingParams(temperature=0, max_tokens=4, n=2), use_tqdm=False
        )
    assert [[c.text for c in r.outputs] for r in results] == [[echo(f"p{i}", 4)] * 2 for i in range(4)]


def test_bad_prompts_and_options_name_the_field(llm):
    with pytest.raises(ParameterError, match="unknown sampling parameter 'temprature'") as err:
        SamplingParams(temprature=0)
    assert err.value.field == "temprature"
    with pytest.raises(ParameterError) as err:
        llm.start_request([5, 99999])
    assert err.value.field == "prompt" and "[0, 257)" in str(err.value)
    with pytest.raises(ParameterError) as err:
        llm.start_request("")
    assert err.value.field == "prompt"
    with pytest.raises(ParameterError) as err:
        llm.start_request("x" * 2000, SamplingParams(max_tokens=100))
    assert err.value.field == "max_tokens" and "context length of 2048" in str(err.value)
    with pytest.raises(ParameterError) as err:
        llm.start_request([{"role": "robot", "content": "hi"}])
    assert err.value.field == "messages[0].role"
    with pytest.raises(ParameterError, match="prompt 1:"):
        llm.generate(["ok", ""], use_tqdm=False)
    results = llm.generate_iter(["ok", "", "fine"], SamplingParams(max_tokens=4), use_tqdm=False, errors="return")
    assert [(r.text, r.finish_reason) for r in results] == [("Echo", "length"), ("", "error"), ("Echo", "length")]
    with pytest.raises(ParameterError, match="unknown option 'max_users'"):
        LLM(mock=True, max_users=4)
    assert wait_for(lambda: idle(llm))


def test_close_interrupts_open_requests_and_stops_the_engine():
    llm = LLM(mock=True, rows=1, mock_tokens_per_second=50)
    running = llm.start_request("r", SamplingParams(max_tokens=1000))
    waiting = llm.start_request("w", SamplingParams(max_tokens=1000))
    assert wait_for(lambda: running.status is RequestStatus.GENERATING, interval=FAST)
    process = llm._client.process
    with llm:
        pass  # the context manager closes it
    assert running.status is RequestStatus.INTERRUPTED and waiting.status is RequestStatus.INTERRUPTED
    assert waiting.queue.get().error == "the LLM was closed"
    assert not process.is_alive()
    with pytest.raises(EngineError, match="closed"):
        llm.start_request("again")


def test_a_program_that_never_closes_its_llm_still_ends(tmp_path):
    """A script that makes an LLM and returns without close(): the engine is stopped at exit (it ignores
    SIGTERM, so multiprocessing's exit handler, joining its children, used to wait on it for ever)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from inference_api import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM(mock=True)\n"
        "    print(llm.generate(['hi'], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # (the package is the checkout's, not installed)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Echo"


def test_a_script_without_a_main_guard_fails_at_once_saying_why(tmp_path):
    """An LLM made at a script's top level: the spawned engine process imports the script again, whose LLM would
    start another engine; it used to hang there, and the script with it. Now the child stops with the reason and
    the script's LLM fails at once."""
    import os
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("from inference_api import LLM\nllm = LLM(mock=True)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "if __name__ == '__main__':" in done.stderr and "the engine did not start" in done.stderr


def test_engine_death_interrupts_open_requests_with_the_error():
    import os
    import signal

    with LLM(mock=True, rows=1, mock_tokens_per_second=50) as llm:
        running = llm.start_request("r", SamplingParams(max_tokens=1000))
        waiting = llm.start_request("w", SamplingParams(max_tokens=1000))
        assert wait_for(lambda: running.status is RequestStatus.GENERATING, interval=FAST)
        os.kill(llm._client.process.pid, signal.SIGKILL)
        for handle in (running, waiting):
            assert llm.sync_request(handle, timeout=30) is RequestStatus.INTERRUPTED
            assert handle.finish_reason == "error" and "exited" in handle.queue.error


def test_past_the_restart_bound_the_llm_fails_and_the_program_lives_on():
    import os
    import signal

    # the server's worker exits past the bound (gunicorn replaces it); a user's program must not be signalled
    with LLM(mock=True, rows=1, engine_max_restarts=0) as llm:
        os.kill(llm._client.process.pid, signal.SIGKILL)
        assert wait_for(lambda: llm._client.failure is not None, interval=FAST)
        assert "crashed" in llm._client.failure
        with pytest.raises(EngineError, match="crashed"):
            llm.start_request("after")
