"""Fixtures for the OpenAI and TGI API tests: clients on the session's servers, the native API's answers."""

from __future__ import annotations

import pytest
import requests
import servers


@pytest.fixture(scope="session")
def oai(real_server):
    from openai import OpenAI

    return OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def native(real_server, model_name):
    """The native API's non-streaming answer: greedy unless told otherwise; chat goes through /predictions."""

    def call(text: str, max_tokens: int, chat: bool = False, **fields) -> dict:
        body = {"text": text, "max_tokens": max_tokens, "temperature": 0, "stream": False, **fields}
        response = servers.native(real_server, model_name, body, chat=chat, timeout=60)
        response.raise_for_status()
        return response.json()

    return call


@pytest.fixture(scope="session")
def sse_data():
    """The ``data:`` payloads of a server-sent-events body, checking the framing on the way."""

    def parse(response: requests.Response) -> list[str]:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        body = response.content.decode()
        assert body.endswith("\n\n"), body[-200:]
        events = body[:-2].split("\n\n")
        assert all(e.startswith("data: ") and "\n" not in e for e in events), body[:500]
        return [e[len("data: ") :] for e in events]

    return parse


@pytest.fixture(scope="module")
def proxy(server):
    """The JWT proxy in front of the module's own ``server`` fixture."""
    with servers.jwt_proxy(server.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def client(proxy):
    """The official openai client on that proxy, with a team's token."""
    from openai import OpenAI

    return OpenAI(base_url=proxy.url + "/v1", api_key=servers.team_token(), max_retries=0, timeout=120)
