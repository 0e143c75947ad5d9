"""Reasoning output on a model that thinks: the tiny random qwen3think GGUF (tests/data/gguf; its chat template opens
a thought at the assistant's turn, its vocabulary has <think> and </think>), served with a reasoning budget and
behind the JWT proxy, with the official clients unchanged: the thought as ``reasoning_content`` in chat (streamed
as its own deltas), as a reasoning item in the Responses API, as a thinking block in Messages; the budget per
request and per server (the engine forces the close); ``reasoning_format: none`` as before; grammars and forced
tool calls constrain only the answer; and one row's thought never changes another row's answer.

A random model never closes its thought by itself, so a budget is what ends every thought here: the thought is the
budget's tokens, then the forced close (</think>, as llama-server writes it), then the answer."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
import requests
from gguf_reference import GGUF_DIR
from servers import MODEL_CACHE, ServerProcess, jwt_proxy, team_token

MODEL = "qwen3think-q4_k_m"
SERVER_BUDGET = 10
CLOSE = 1  # the forced close: "</think>", one token
ASK = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def think_server():
    flags = ["--model", str(GGUF_DIR / f"{MODEL}.gguf"), "--model-cache-dir", MODEL_CACHE, "--rows", "8"]
    with ServerProcess(*flags, "--reasoning-budget", str(SERVER_BUDGET), "--context-length", "1024") as server:
        yield server


@pytest.fixture(scope="module")
def proxy_url(think_server):
    with jwt_proxy(think_server.url) as proxy:
        yield proxy.url


def key(team: str = "team-think") -> str:
    return team_token(team_id=team, token_id=f"{team}-key")


@pytest.fixture(scope="module")
def oai(proxy_url):
    return openai.OpenAI(base_url=proxy_url + "/v1", api_key=key(), max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(proxy_url):
    return anthropic.Anthropic(base_url=proxy_url, api_key=key(), max_retries=0, timeout=60)


def chat(oai, **extra):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 30, "temperature": 1.0, "seed": 7, **extra}
    extras = ("thinking_budget_tokens", "reasoning_format", "structured_outputs")
    extra_body = {k: body.pop(k) for k in extras if k in body}
    return oai.chat.completions.create(**body, extra_body=extra_body or None)


def test_chat_returns_the_thought_apart_and_the_budget_closes_it(oai):
    done = chat(oai, thinking_budget_tokens=6)
    message = done.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert "</think>" not in (message.content or "")
    assert done.usage.completion_tokens_details.reasoning_tokens == 6 + CLOSE
    # the same tokens as written (reasoning_format none: today's behaviour): the thought, the close, the answer
    raw = chat(oai, thinking_budget_tokens=6, reasoning_format="none").choices[0].message
    assert "reasoning_content" not in (raw.model_extra or {})
    before, after = raw.content.split("</think>", 1)
    assert before.strip() == thought and after.lstrip() == message.content


def test_the_servers_budget_holds_unless_the_request_gives_one(oai):
    assert chat(oai).usage.completion_tokens_details.reasoning_tokens == SERVER_BUDGET + CLOSE
    assert chat(oai, thinking_budget_tokens=3).usage.completion_tokens_details.reasoning_tokens == 3 + CLOSE
    closed = chat(oai, reasoning_effort="none")  # a budget of 0: closed at once, nothing thought
    assert "reasoning_content" not in (closed.choices[0].message.model_extra or {})
    assert closed.usage.completion_tokens_details.reasoning_tokens == CLOSE


def test_a_streamed_thought_comes_as_its_own_deltas_before_the_answer(oai):
    whole = chat(oai, thinking_budget_tokens=5).choices[0].message
    stream = chat(oai, thinking_budget_tokens=5, stream=True, stream_options={"include_usage": True})
    kinds, thought, answer, usage = [], [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                kinds.append("thought")
                thought.append(extra["reasoning_content"])
            if choice.delta.content:
                kinds.append("answer")
                answer.append(choice.delta.content)
    assert "".join(thought) == whole.model_extra["reasoning_content"] and "".join(answer) == whole.content
    assert kinds.index("answer") > len(thought) - 1 and "thought" not in kinds[kinds.index("answer") :]
    assert usage.completion_tokens_details.reasoning_tokens == 5 + CLOSE


def test_every_choice_thinks_on_its_own(oai):
    done = chat(oai, thinking_budget_tokens=4, n=2)
    assert all(c.message.model_extra["reasoning_content"] for c in done.choices)
    assert done.usage.completion_tokens_details.reasoning_tokens == 2 * (4 + CLOSE)


def test_a_grammar_constrains_the_answer_not_the_thought(oai):
    done = chat(oai, thinking_budget_tokens=5, structured_outputs={"choice": ["left", "right"]}, max_tokens=40)
    message = done.choices[0].message
    assert message.model_extra["reasoning_content"]  # the thought is free text, not one of the choices
    assert message.content in ("left", "right") and done.choices[0].finish_reason == "stop"


def test_a_forced_call_comes_after_the_thought(oai):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    done = chat(oai, thinking_budget_tokens=4, tools=tools, tool_choice="required", max_tokens=300)
    message = done.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert [c.function.name for c in message.tool_calls] == ["weather"]
    assert json.loads(message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Rome")


def test_responses_return_a_reasoning_item(oai):
    seeded = {"extra_body": {"seed": 7}}  # (this server's seed: the same random thought every run)
    done = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=30, temperature=1.0, **seeded)
    kinds = [item.type for item in done.output]
    assert kinds[0] == "reasoning" and set(kinds) <= {"reasoning", "message"}
    assert done.output[0].content[0].type == "reasoning_text" and done.output[0].content[0].text
    assert done.usage.output_tokens_details.reasoning_tokens == SERVER_BUDGET + CLOSE
    events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=30, stream=True, **seeded))
    types = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == deltas
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    # reasoning effort none: no thought, no reasoning item
    closed = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=10, reasoning={"effort": "none"}, **seeded)
    assert [item.type for item in closed.output] == ["message"]
    # the reasoning item sent back with the next turn's input is accepted
    again = oai.responses.create(
        model=MODEL, input=[*[i.model_dump() for i in done.output], {"role": "user", "content": "And?"}], **seeded
    )
    assert again.status in ("completed", "incomplete")


def test_messages_return_a_thinking_block(claude):
    seeded = {"extra_body": {"seed": 7}}  # (this server's seed: the same random thought every run)
    done = claude.messages.create(
        model=MODEL, max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 4}, **seeded
    )
    assert done.content[0].type == "thinking" and done.content[0].thinking
    with claude.messages.stream(
        model=MODEL, max_tokens=30, messages=ASK, thinking={"type": "enabled", "budget_tokens": 4}, **seeded
    ) as stream:
        thought = "".join(e.thinking for e in stream if e.type == "thinking")
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thought
    assert [b.type for b in final.content[1:]] in ([], ["text"])
    # disabled: the thought is closed at once; a thinking block sent back in the history is accepted
    plain = claude.messages.create(model=MODEL, max_tokens=10, messages=ASK, thinking={"type": "disabled"}, **seeded)
    assert [b.type for b in plain.content] in ([], ["text"])
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in done.content]}, *ASK]
    assert claude.messages.create(model=MODEL, max_tokens=5, messages=history, **seeded).content is not None


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": ASK, "thinking_budget_tokens": -2}, "thinking_budget_tokens"),
        ("/v1/chat/completions", {"messages": ASK, "reasoning_format": "xml"}, "reasoning_format"),
        ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ("/v1/messages", {"messages": ASK, "max_tokens": 9, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ],
)
def test_bad_thinking_fields_are_400s_in_each_apis_shape(proxy_url, path, body, field):
    r = requests.post(
        proxy_url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {key()}"}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] or error.get("param") == field
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"


def test_one_rows_thought_never_changes_another_rows_answer(think_server):
    """The victim's seeded answer (thought and all) alone equals its answer beside other rows that think under
    other budgets, are closed at once, hold a grammar, fork n choices or keep their thought in the text."""
    url = think_server.url + "/v1/chat/completions"
    victim = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 1.0, "seed": 11, "logprobs": True}

    def ask(body: dict) -> dict:
        r = requests.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def seen(body: dict) -> tuple:
        done = ask(body)
        message = done["choices"][0]["message"]
        tokens = [t["token"] for t in done["choices"][0]["logprobs"]["content"]]
        return message.get("reasoning_content"), message["content"], tokens

    alone = seen(victim)
    others = [
        {"thinking_budget_tokens": 1},
        {"thinking_budget_tokens": 0, "max_tokens": 16},
        {"reasoning_format": "none", "seed": 2},
        {"n": 3, "thinking_budget_tokens": 3},
        {"response_format": {"type": "json_object"}, "thinking_budget_tokens": 2, "max_tokens": 40},
        {"stream": True, "thinking_budget_tokens": 4},
    ]
    with ThreadPoolExecutor(len(others) + 1) as pool:
        bodies = [{**victim, "logprobs": False, **o} for o in others]
        running = [pool.submit(requests.post, url, json=body, timeout=120) for body in bodies]
        beside = pool.submit(seen, victim)
        assert beside.result() == alone
        assert all(f.result().status_code == 200 for f in running)
