"""n choices from one prefill, echo and prompt log-probs, through the real openai client on the real model."""

from __future__ import annotations

import re
import threading
from collections import defaultdict

import requests
from servers import wait_for, wait_idle

PROMPT = "The three most useful kitchen tools are"


def prefix_counters(server) -> tuple[float, float]:
    """(prompt tokens looked up, found) in the prefix cache, from /metrics."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    got = {m[0]: float(m[1]) for m in re.findall(r"^(inference_prefix_cache_\w+_total) (\S+)$", text, re.M)}
    return got["inference_prefix_cache_queries_total"], got["inference_prefix_cache_hits_total"]


def test_n_choices_come_from_one_prefill_greedy_equal(oai, model_name, real_server):
    before = prefix_counters(real_server)
    prompt = PROMPT + " (n=4, greedy)"
    out = oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, n=4)
    queried, hit = (a - b for a, b in zip(prefix_counters(real_server), before))
    alone = oai.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert {c.text for c in out.choices} == {alone.choices[0].text}  # greedy: n equal choices, as vLLM
    p = out.usage.prompt_tokens
    assert p == alone.usage.prompt_tokens and out.usage.completion_tokens == 4 * alone.usage.completion_tokens
    # choices 1..3 found the prompt (all but its last token) in choice 0's row: computed once
    assert queried == 4 * p and hit == 3 * (p - 1) + out.usage.prompt_tokens_details.cached_tokens


def test_seeded_choices_are_reproducible_distinct_and_streamed_alike(oai, model_name):
    messages = [{"role": "user", "content": "Name a fruit and say why you like it."}]
    args = dict(model=model_name, messages=messages, max_tokens=6, temperature=1.0, seed=1234, n=4)
    response = oai.chat.completions.create(**args)
    first = [c.message.content for c in response.choices]
    assert len(set(first)) > 1  # each choice its own seed, derived from (seed, index)
    single = oai.chat.completions.create(**{**args, "n": 1}).choices[0].message.content
    assert single == first[0]  # choice 0 keeps the request's seed
    texts, finishes, usage = defaultdict(str), defaultdict(list), None
    for chunk in oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    # the same again, streamed: every choice reproduced, each with one finish chunk
    assert [texts[i] for i in range(4)] == first and all(len(finishes[i]) == 1 for i in range(4))
    assert usage.completion_tokens == response.usage.completion_tokens  # every choice's, the prompt once
    assert usage.prompt_tokens == response.usage.prompt_tokens


def test_echo_and_prompt_logprobs_agree_with_the_generated_tokens(oai, model_name, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    plain = oai.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0, logprobs=2)
    echoed = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    whole = hf_tokenizer.encode(PROMPT + plain.choices[0].text)
    assert whole[: len(ids)] == ids and len(whole) == len(ids) + 4  # the answer's tokens, re-tokenized alike
    scored = oai.completions.create(
        model=model_name, prompt=whole, max_tokens=1, temperature=0, logprobs=2, echo=True, n=2
    )
    for choice in scored.choices:  # every choice echoes the prompt and its log-probs
        lp = choice.logprobs
        assert len(lp.tokens) == len(whole) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens[: len(whole)]) == choice.text[: len(hf_tokenizer.decode(whole))]
        assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
        # the prompt's last 4 tokens are the answer's: their log-probs in the prefill equal those of decoding
        for got, want in zip(lp.token_logprobs[len(ids) : len(whole)], plain.choices[0].logprobs.token_logprobs):
            assert abs(got - want) < 2e-3
        assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    vllm = (
        oai.completions.create(
            model=model_name, prompt=whole, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3}
        )
        .choices[0]
        .model_extra["prompt_logprobs"]
    )
    assert len(vllm) == len(whole) and vllm[0] is None  # vLLM's form: {token id: {logprob, rank, decoded_token}}
    for entry, token, want in zip(vllm[1:], whole[1:], scored.choices[0].logprobs.token_logprobs[1:]):
        assert abs(entry[str(token)]["logprob"] - want) < 1e-4 and entry[str(token)]["rank"] >= 1
        assert 3 <= len(entry) <= 4 and sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    streamed = list(
        oai.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    assert streamed[0].choices[0].text == PROMPT and streamed[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain.choices[0].text


def test_cancelling_a_streamed_n4_request_frees_every_row_and_others_are_unchanged(oai, model_name, real_server):
    wait_idle(real_server)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    alone = oai.chat.completions.create(model=model_name, messages=question, max_tokens=16, temperature=0)
    beside = {}

    def other():  # beside the n=4 stream, once it runs
        assert wait_for(lambda: real_server.health()["rows_in_use"] > 0, 60), "the n=4 stream never took a row"
        beside["answer"] = oai.chat.completions.create(
            model=model_name, messages=question, max_tokens=16, temperature=0
        )

    thread = threading.Thread(target=other)
    thread.start()
    stream = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Tell a story."}],
        max_tokens=400,
        temperature=1.0,
        n=4,
        stream=True,
    )
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if len(seen) == 4:
            break
    thread.join()
    stream.close()
    body = wait_idle(real_server)
    assert seen == {0, 1, 2, 3} and body["rows_in_use"] == 0 and body["open_sessions"] == 0
    assert beside["answer"].choices[0].message.content == alone.choices[0].message.content
