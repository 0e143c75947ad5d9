"""The official clients through the JWT proxy (``python -m proxy``): openai with the JWT as its api_key (chat,
completions and the Responses API, whose stored responses are the token's team's), anthropic with it as its
api_key (sent as ``x-api-key``), and text-generation with it in an Authorization header."""

from __future__ import annotations

import asyncio

import openai
import pytest
from servers import ROOT, jwt_proxy, team_token
from text_generation import AsyncClient, Client
from text_generation.errors import UnknownError

pytestmark = pytest.mark.skipif(not (ROOT / "proxy" / "__main__.py").exists(), reason="proxy not present")


@pytest.fixture(scope="module")
def proxy_url(real_server):
    with jwt_proxy(real_server.url) as proxy:
        yield proxy.url


def token(**claims) -> str:
    return team_token(**claims)


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


def test_responses_through_the_proxy_are_the_tokens_teams(proxy_url, model_name):
    client = openai.OpenAI(base_url=proxy_url + "/v1", api_key=token(), max_retries=0, timeout=60)
    first = client.responses.create(model=model_name, input="My name is Ada.", max_output_tokens=6, temperature=0)
    # (a stream cut at max_output_tokens ends with response.incomplete, as OpenAI's: read the last event's response)
    events = list(
        client.responses.create(
            model=model_name, input="And yours?", previous_response_id=first.id, max_output_tokens=6, stream=True
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")
    second = events[-1].response
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    other = openai.OpenAI(base_url=proxy_url + "/v1", api_key=token(team_id="team-b"), max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_anthropic_client_through_the_proxy(proxy_url, real_server, model_name):
    import anthropic

    kwargs = dict(model=model_name, max_tokens=6, messages=[{"role": "user", "content": "Name a planet."}])
    greedy = {"extra_body": {"temperature": 0}}
    direct = anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)
    client = anthropic.Anthropic(base_url=proxy_url, api_key=token(), max_retries=0, timeout=60)  # x-api-key
    text = client.messages.create(**kwargs, **greedy).content[0].text
    assert text == direct.messages.create(**kwargs, **greedy).content[0].text
    with client.messages.stream(**kwargs, **greedy) as stream:
        assert stream.get_final_message().content[0].text == text
    assert client.messages.count_tokens(model=model_name, messages=kwargs["messages"]).input_tokens > 0
    forged = anthropic.Anthropic(base_url=proxy_url, api_key=token()[:-4] + "AAAA", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        forged.messages.create(**kwargs)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"


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
