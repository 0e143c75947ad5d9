"""The offline API with the real default model: greedy ``generate`` and ``chat`` over the native tests' prompt
list give the server's greedy answers for the same prompts."""

from __future__ import annotations

import time

import pytest
from greedy import MAX_TOKENS, PROMPTS, assert_greedy_equivalent, served_answers
from servers import MODEL_CACHE

from inference_api import LLM, ParameterError, SamplingParams


@pytest.fixture(scope="module")
def llm():
    # the real_server fixture's flags (the exact mode)
    with LLM(model_cache_dir=MODEL_CACHE, context_length=1024, quantize="none", dtype="float32") as llm:
        yield llm


@pytest.mark.parametrize("chat", [False, True], ids=["generate", "chat"])
def test_greedy_offline_answers_equal_the_servers(llm, real_server, model_name, chat, request):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = PROMPTS[::4] if chat else PROMPTS  # all 40 through generate; the template on a quarter of them
    started = time.monotonic()
    if chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    offline_s = time.monotonic() - started
    served = served_answers(real_server, model_name, [(p, chat) for p in prompts])
    server_s = time.monotonic() - started - offline_s
    print(f"offline {offline_s:.1f} s, server {server_s:.1f} s for {len(prompts)} prompts")
    assert [r.index for r in results] == list(range(len(prompts)))
    assert len({r.text for r in results}) > len(prompts) * 3 // 4  # distinct prompts, distinct answers
    differ = [(p, r.text, s) for p, r, s in zip(prompts, results, served) if r.text != s]
    print(f"{len(differ)} of {len(prompts)} answers differ")
    for prompt, offline_text, server_text in differ:  # only a near-tie in the model may part them
        ref = request.getfixturevalue("reference")
        assert_greedy_equivalent(offline_text, prompt, chat, ref)
        assert_greedy_equivalent(server_text, prompt, chat, ref)
    assert len(differ) <= 2, differ
    for r in results:
        assert r.finish_reason in ("length", "eos") and 0 < r.completion_tokens <= MAX_TOKENS
        assert (
            r.prompt_tokens
            == len(r.prompt_token_ids)
            == len(
                llm.tokenizer.encode_chat([{"role": "user", "content": r.prompt[0]["content"]}])
                if chat
                else llm.tokenizer.encode(r.prompt)
            )
        )


def test_structured_output_offline(llm):
    """The same constraint fields as /v1/completions, in SamplingParams."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    results = llm.generate(
        ["The capital of France, as JSON:", "Is water wet? Answer:"],
        [
            SamplingParams(temperature=0, max_tokens=40, guided_json=schema),
            SamplingParams(temperature=0, max_tokens=8, guided_choice=["yes", "no"]),
        ],
        use_tqdm=False,
    )
    jsonschema.validate(json.loads(results[0].text), schema)
    assert results[1].text in ("yes", "no") and results[1].finish_reason == "stop"
    with pytest.raises(ParameterError) as err:
        SamplingParams(guided_regex="(?=a)")
    assert err.value.field == "guided_regex"


def test_tools_offline(llm):
    """LLM.chat takes the chat API's tools: a required call is forced by the grammar and parsed into tool_calls
    (the text keeps the model's whole answer); bad tools raise ParameterError naming the field."""
    import json

    import jsonschema
    from api.test_tools_real import ASK, SCHEMAS, TOOLS

    forced, again = llm.chat(
        [ASK, ASK], SamplingParams(temperature=0, max_tokens=60), tools=TOOLS, tool_choice="required", use_tqdm=False
    )
    assert forced.tool_calls and forced.text.startswith("<tool_call>")
    for call in forced.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert [(c.name, c.arguments) for c in again.tool_calls] == [(c.name, c.arguments) for c in forced.tool_calls]
    plain = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert plain.tool_calls == () and plain.prompt_tokens < forced.prompt_tokens  # the tools were shown
    with pytest.raises(ParameterError) as err:
        llm.chat(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.field == "tool_choice.function.name"
