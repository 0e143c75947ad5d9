"""Deploys and crashes, with real processes on loopback: drain on SIGTERM, no orphaned engine, post-processing
faults isolated, pre-flight refusal of settings that cannot fit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
from servers import MODEL_CACHE, MODEL_NAME, ROOT, ServerProcess, alive, native, stream_into, wait_for

SCRIPT = "Echo: ab — "  # what the mock backend says to the prompt "ab", over and over
WHOLE = 9 * len(SCRIPT.encode())  # tokens (bytes) of nine whole repetitions


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def sse_events(response: requests.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def native_stream(url: str, tokens: int, out: dict, key: str) -> None:
    stream_into(out, key, f"{url}/inference/{MODEL_NAME}", {"text": "ab", "max_tokens": tokens})


def openai_stream(url: str, tokens: int, out: dict, key: str) -> None:
    body = {"model": MODEL_NAME, "prompt": "ab", "max_tokens": tokens, "stream": True}
    stream_into(out, key, f"{url}/v1/completions", body, sse_events)


def tgi_stream(url: str, tokens: int, out: dict, key: str) -> None:
    body = {"inputs": "ab", "parameters": {"max_new_tokens": tokens}}
    stream_into(out, key, f"{url}/generate_stream", body, sse_events)


def health_status(server) -> int:
    return requests.get(server.url + "/health", timeout=5).status_code


def start_streams(
    url: str, tokens: int, kinds=(native_stream, native_stream, native_stream, openai_stream, tgi_stream)
) -> tuple[list[threading.Thread], dict]:
    """One thread per stream of ``kinds``; ``out`` gets each one's result under its kind's name and place."""
    out: dict = {}
    threads = [threading.Thread(target=f, args=(url, tokens, out, f"{f.__name__}{i}")) for i, f in enumerate(kinds)]
    for t in threads:
        t.start()
    return threads, out


def test_sigterm_drains_streams_longer_than_the_old_graceful_timeout():
    with ServerProcess("--mock", "--mock-tokens-per-second", "10") as server:  # WHOLE tokens take about 11.7 s
        engine = server.health()["backend_pid"]
        threads, out = start_streams(server.url, WHOLE)
        assert wait_for(lambda: server.health()["rows_in_use"] == len(threads), 20)
        server.proc.send_signal(signal.SIGTERM)  # to gunicorn's master, as a process manager does
        started = time.monotonic()
        # the master passes the signal on to the worker: a moment later the health check says draining
        assert wait_for(lambda: health_status(server) == 503, 10)
        assert requests.get(server.url + "/health", timeout=5).json()["status"] == "draining"
        refused = native(server, MODEL_NAME, {"text": "new"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["status_code"] == 503
        oai = requests.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "new"}, timeout=5)
        assert oai.status_code == 503 and oai.json()["error"]["type"] == "server_error"
        tgi = requests.post(f"{server.url}/generate", json={"inputs": "new"}, timeout=5)
        assert tgi.status_code == 503 and tgi.json()["error_type"] == "overloaded"
        # the same path, told apart by the body: shortfin's shape
        shortfin = requests.post(f"{server.url}/generate", json={"text": "new"}, timeout=5)
        assert shortfin.status_code == 503 and shortfin.json()["code"] == "QUEUE_FULL"
        assert all(int(r.headers["Retry-After"]) > 0 for r in (refused, oai, tgi, shortfin))
        for t in threads:
            t.join(120)
        # they ran past gunicorn's old fixed 10 s, which would have cut them. A lower bound, which load only raises:
        # the mock waits a whole step between tokens (it never catches up), and the streams, admitted just before
        # SIGTERM, had nearly all of their 11.7 s to go
        assert time.monotonic() - started > 10
        for key, value in out.items():
            if key.startswith("native"):
                assert value == SCRIPT * 9, (key, value)
            elif key.startswith("openai"):
                assert value[-1] == "[DONE]" and json.loads(value[-2])["choices"][0]["finish_reason"] == "length"
                assert "".join(json.loads(v)["choices"][0]["text"] for v in value[:-1]) == SCRIPT * 9
            else:
                last = json.loads(value[-1])
                assert last["generated_text"] == SCRIPT * 9 and last["details"]["finish_reason"] == "length"
        server.proc.wait(30)
        assert wait_for(lambda: not alive(engine), 5)


def test_drain_deadline_ends_unfinished_streams_as_failed_streams():
    with ServerProcess("--mock", "--mock-tokens-per-second", "20", "--drain-timeout", "2") as server:
        engine = server.health()["backend_pid"]
        threads, out = start_streams(server.url, 1000, (native_stream, openai_stream, tgi_stream))
        assert wait_for(lambda: server.health()["rows_in_use"] == 3, 20)
        os.killpg(server.proc.pid, signal.SIGTERM)  # the whole group, as systemd or a container stop does
        for t in threads:
            t.join(60)
        native, openai, tgi = out["native_stream0"], out["openai_stream1"], out["tgi_stream2"]
        assert isinstance(native, requests.exceptions.ChunkedEncodingError)  # cut, not ended as complete
        assert "error" in json.loads(openai[-1]) and openai[-1] != "[DONE]"
        assert "error" in json.loads(tgi[-1])
        server.proc.wait(30)
        assert wait_for(lambda: not alive(engine), 5)


def test_engine_dies_with_its_worker_busy_or_idle(model_name):
    with ServerProcess("--mock", "--mock-tokens-per-second", "20") as server:
        for busy in (True, False):
            engine = server.health()["backend_pid"]
            worker = parent_of(engine)
            assert worker != server.proc.pid
            if busy:
                out: dict = {}
                stream = threading.Thread(target=native_stream, args=(server.url, 1000, out, "s"))
                stream.start()
                assert wait_for(lambda: server.health()["rows_in_use"] == 1, 20)
            os.kill(worker, signal.SIGKILL)
            assert wait_for(lambda engine=engine: not alive(engine), 10, 0.02), (
                f"engine {engine} outlived its worker (busy={busy})"
            )
            if busy:
                stream.join(30)
                assert isinstance(out["s"], requests.RequestException)
            # gunicorn starts a new worker, which starts a new engine
            assert wait_for(lambda: health_status(server) == 200, 60, 0.2)
            assert server.health()["backend_pid"] != engine


def test_past_the_restart_bound_the_worker_exits_and_gunicorn_replaces_it():
    with ServerProcess("--mock", "--engine-max-restarts", "0") as server:
        engine = server.health()["backend_pid"]
        worker = parent_of(engine)
        os.kill(engine, signal.SIGKILL)
        assert wait_for(lambda: not alive(worker), 20, 0.1), "the worker did not give up"
        assert wait_for(lambda: health_status(server) == 200, 60, 0.2)
        assert parent_of(server.health()["backend_pid"]) not in (worker, server.proc.pid)


def test_a_post_processing_fault_fails_only_its_request(model_name):
    with ServerProcess("--mock", "--mock-tokens-per-second", "50", env={"TEST_FAULT_TEXT": "kaboom"}) as server:
        engine = server.health()["backend_pid"]
        out: dict = {}
        healthy = threading.Thread(target=native_stream, args=(server.url, 3 * len(SCRIPT.encode()), out, "ok"))
        healthy.start()
        assert wait_for(lambda: server.health()["rows_in_use"] == 1, 20)
        bad = native(server, MODEL_NAME, {"text": "kaboom", "stream": False})
        # the client gets a generic error; the fault's own text is in the server's log only
        assert bad.status_code == 503 and "failed on the server" in bad.json()["message"]
        assert "injected post-processing fault" not in bad.text
        assert wait_for(lambda: "injected post-processing fault" in server.output(), 10)
        bad_stream = requests.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": "kaboom", "stream": True},
            stream=True,
            timeout=30,
        )
        assert bad_stream.status_code == 503
        healthy.join(30)
        assert out["ok"] == SCRIPT * 3
        health = server.health()
        assert health["status"] == "ready" and health["backend_pid"] == engine and health["engine_restarts"] == 0
        assert native(server, MODEL_NAME, {"text": "ab", "max_tokens": 4}).text == "Echo"


def test_a_context_length_beyond_memory_exits_at_once_with_the_numbers():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inference_api",
            "--model-cache-dir",
            MODEL_CACHE,
            "--context-length",
            "100000000",
            "--port",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "SKIP_PREFLIGHT"},
    )
    assert proc.returncode == 2
    message = proc.stderr
    # at once: the refusal is all it said, before any weights loaded or any server started (either logs a line)
    assert proc.stdout == "" and message.startswith("python -m inference_api: pre-flight:"), message
    assert len(message.strip().splitlines()) == 1, message
    assert "does not fit" in message and "GiB of RAM needed" in message and "free" in message
    for flag in ("--rows", "--context-length", "--dtype", "--kv-dtype", "--quantize", "--skip-preflight"):
        assert flag in message


def test_health_reports_the_preflight_numbers(real_server):
    memory = real_server.health()["memory"]
    parts = ("weights_bytes", "kv_cache_bytes", "overhead_bytes", "prompt_cache_bytes")
    assert memory["needed_bytes"] == sum(memory[p] for p in parts)
    assert 0 < memory["prompt_cache_bytes"] <= 4 << 30  # the prompt cache's budget (--cache-ram auto), host memory
    assert 0 < memory["needed_bytes"] < memory["free_bytes"] + memory["needed_bytes"]
    assert "pre-flight:" in Path(real_server.log.name).read_text()  # the start-up line with the numbers


def test_the_server_returns_and_logs_the_request_id(mock_server, model_name):
    r = native(mock_server, model_name, {"text": "ab", "max_tokens": 13}, headers={"X-Request-Id": "trace-42"})
    assert r.headers["X-Request-Id"] == "trace-42"

    def logged():
        lines = [json.loads(line) for line in mock_server.output().splitlines() if '"trace-42"' in line]
        return lines and lines[-1]

    assert wait_for(logged, 5)
    line = logged()
    assert line["status"] == 200 and line["tokens_out"] == 13 and line["finish_reason"] == "length"
    assert line["ttft_ms"] is not None and line["ttft_ms"] >= 0 and line["api"] == "native"
    assert requests.get(mock_server.url + "/health", timeout=5).headers["X-Request-Id"]


def test_the_server_has_header_and_body_deadlines(model_name):
    with (
        ServerProcess("--mock", "--header-timeout", "1", "--body-timeout", "1") as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as headers,
        socket.create_connection(("127.0.0.1", server.port), timeout=20) as body,
    ):
        headers.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        body.sendall(
            f"POST /inference/{model_name} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f'Content-Length: 100\r\n\r\n{{"text": '.encode()
        )
        assert read_all(headers) == b""  # closed, unanswered
        answer = read_all(body)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"not received within 1 s" in answer
        assert server.health()["status"] == "ready"


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data
