"""The official clients through the JWT proxy (``python -m proxy``): openai with the JWT as its api_key, and
text-generation with it in an Authorization header."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest
import requests
from servers import ROOT, free_port
from text_generation import AsyncClient, Client
from text_generation.errors import UnknownError

SECRET = "test-secret-" + "x" * 40  # at least 32 bytes, or the proxy warns

pytestmark = pytest.mark.skipif(not (ROOT / "proxy" / "__main__.py").exists(), reason="proxy not present")


@pytest.fixture(scope="module")
def proxy_url(real_server):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="proxy-", suffix=".log", delete=False)  # noqa: SIM115 (the proxy writes it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(port), "--upstream", real_server.url],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "JWT_SECRET": SECRET},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("proxy did not start:\n" + Path(log.name).read_text(errors="replace")[-3000:])
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)


def token(**claims) -> str:
    import jwt

    return jwt.encode(
        {"team_id": "team-a", "token_id": "key-1", "exp": int(time.time()) + 3600, **claims}, SECRET, algorithm="HS256"
    )


def test_openai_client_through_the_proxy(proxy_url, oai, model_name):
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=token(), max_retries=0, timeout=60)
    kwargs = dict(
        model=model_name, messages=[{"role": "user", "content": "Name a planet."}], max_tokens=6, temperature=0
    )
    direct = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == direct
    streamed = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == direct
    assert chunks[-1].usage.completion_tokens > 0
    assert [m.id for m in client.models.list()] == [model_name]


def test_bad_jwt_is_an_authentication_error(proxy_url, model_name):
    forged = openai.OpenAI(base_url=proxy_url + "/v1", api_key=token()[:-4] + "AAAA", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        forged.models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy_url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=model_name, prompt="hi", max_tokens=2
        )


def test_async_openai_client_streams_through_the_proxy(proxy_url, oai, model_name):
    kwargs = dict(model=model_name, prompt="The capital of Italy is", max_tokens=8, temperature=0)
    direct = oai.completions.create(**kwargs).choices[0].text

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=proxy_url + "/v1", api_key=token(), max_retries=0, timeout=60)
        async with client:
            stream = await client.completions.create(**kwargs, stream=True)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    assert asyncio.run(run()) == direct


def test_text_generation_client_through_the_proxy(proxy_url, real_server):
    prompt, n = "The three primary colors are", 10
    direct = Client(real_server.url, timeout=60).generate(prompt, max_new_tokens=n)
    client = Client(proxy_url, headers={"Authorization": f"Bearer {token()}"}, timeout=60)
    out = client.generate(prompt, max_new_tokens=n)
    assert out.generated_text == direct.generated_text
    assert out.details.generated_tokens == direct.details.generated_tokens
    events = list(client.generate_stream(prompt, max_new_tokens=n))
    assert "".join(e.token.text for e in events if not e.token.special) == direct.generated_text
    assert events[-1].generated_text == direct.generated_text

    async def run_async() -> str:
        response = await AsyncClient(proxy_url, headers={"Authorization": f"Bearer {token()}"}, timeout=60).generate(
            prompt, max_new_tokens=n
        )
        return response.generated_text

    assert asyncio.run(run_async()) == direct.generated_text
    with pytest.raises(UnknownError):  # the proxy's 401 reaches the client as an error, not as an answer
        Client(proxy_url, timeout=10).generate(prompt, max_new_tokens=2)
