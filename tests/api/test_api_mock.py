"""OpenAI and TGI endpoints over the mock backend: queue-full 503s, and engine failures mid-stream."""

from __future__ import annotations

import json
import os
import signal
import socket

import openai
import pytest
import requests
import text_generation
from servers import ServerProcess, wait_for


def open_chat_stream(server, model_name: str, text: str) -> socket.socket:
    """A streaming chat request on a raw socket, left unread: it holds a row or a queue place."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps(
        {"model": model_name, "messages": [{"role": "user", "content": text}], "max_tokens": 500, "stream": True}
    ).encode()
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def test_queue_full_gives_503_with_retry_after_in_each_api_format(mock_server, model_name):
    mock_server.wait_idle()
    socks = [open_chat_stream(mock_server, model_name, f"user {i}") for i in range(8)]  # 4 rows + 4 places
    try:
        assert wait_for(lambda: mock_server.health()["open_sessions"] == 8, 10), mock_server.health()
        r = requests.post(
            mock_server.url + "/v1/chat/completions",
            timeout=10,
            json={"model": model_name, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "busy" in error["message"]
        client = openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=model_name, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        with pytest.raises(text_generation.errors.OverloadedError):
            text_generation.Client(mock_server.url).generate("hi", max_new_tokens=2)
        r = requests.post(mock_server.url + "/generate", json={"inputs": "hi"}, timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error_type"] == "overloaded"
    finally:
        for sock in socks:
            sock.close()
    assert mock_server.wait_idle(timeout=10)["open_sessions"] == 0


def test_each_stream_gets_its_own_echo(mock_server, model_name):
    client = openai.OpenAI(base_url=mock_server.url + "/v1", api_key="unused", max_retries=0)
    for name in ("alice", "bob"):
        stream = client.completions.create(model=model_name, prompt=f"I am {name}", max_tokens=20, stream=True)
        assert "".join(c.choices[0].text for c in stream) == (f"Echo: I am {name} — " * 2).encode()[:20].decode()


def test_engine_failure_mid_stream_is_an_error_event(model_name):
    with ServerProcess("--mock", "--mock-tokens-per-second", "20") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "doomed"}], max_tokens=1000, stream=True
        )
        tgi = text_generation.Client(server.url, timeout=30).generate_stream("doomed too", max_new_tokens=1000)
        assert next(chat).choices[0].delta.role == "assistant" and next(tgi).token.text
        os.kill(server.health()["backend_pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError) as info:
            for _ in chat:
                pass
        assert "engine" in info.value.message
        with pytest.raises(text_generation.errors.GenerationError):
            for _ in tgi:
                pass
