"""The greedy check the real-model tests share: 40 prompts, transformers' generate alone as the reference (the
session fixture ``reference`` in conftest.py), and the comparison that accepts only the reference's near-ties."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
from servers import native

MAX_TOKENS = 20
SUBJECTS = [
    "the sea",
    "a robot",
    "Paris",
    "bread",
    "winter",
    "a violin",
    "the moon",
    "coffee",
    "a library",
    "mountains",
    "a cat",
    "rain",
    "trains",
    "chess",
    "gardens",
    "the desert",
    "a lighthouse",
    "honey",
    "volcanoes",
    "a clock",
]
PROMPTS = [f"Write one sentence about {s}." for s in SUBJECTS] + [
    f"Here is a short story about {s}:" for s in SUBJECTS
]  # 40 prompts
JOBS = [(p, i % 5 == 4) for i, p in enumerate(PROMPTS)]  # (prompt, chat): every fifth through the chat template


def served_answers(
    server, model_name: str, jobs: list[tuple[str, bool]], workers: int | None = None, stream: bool = False
) -> list[str]:
    """Each (prompt, chat) job's greedy answer of MAX_TOKENS from the server's native route, ``workers`` requests
    at once (all of them unless told); streamed and joined when ``stream``."""

    def one(job: tuple[str, bool]) -> str:
        prompt, chat = job
        body = {"text": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream}
        r = native(server, model_name, body, chat=chat, timeout=300, stream=stream)
        assert r.status_code == 200, r.text
        return b"".join(r.iter_content(chunk_size=None)).decode("utf-8") if stream else r.json()["text"]

    with ThreadPoolExecutor(workers or len(jobs)) as pool:
        return list(pool.map(one, jobs))


def greedy_reference(model_dir):
    """transformers' own greedy generate, one prompt at a time: the output every request must equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @functools.cache  # greedy and one model: every server (exact, quantized, split over ranks) against one run
    def generate(prompt: str, chat: bool) -> tuple[list[int], list[torch.Tensor], str]:
        if chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        else:
            ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.eos_token_id,
        )
        new = out.sequences[0, ids.shape[1] :].tolist()
        return new, list(out.scores), tok.decode(new, skip_special_tokens=True)

    generate.tokenizer = tok
    return generate


def assert_greedy_equivalent(server_text: str, prompt: str, chat: bool, reference) -> None:
    ref_ids, scores, ref_text = reference(prompt, chat)
    if server_text == ref_text:
        return
    tok = reference.tokenizer
    step = next(
        i
        for i in range(len(ref_ids) + 1)
        if i == len(ref_ids) or not server_text.startswith(tok.decode(ref_ids[: i + 1], skip_special_tokens=True))
    )
    top2 = scores[min(step, len(scores) - 1)][0].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < 1e-4, (
        f"outputs part at step {step} where the reference's top-2 margin is {margin:.2e}:\n"
        f"server:    {server_text!r}\nreference: {ref_text!r}"
    )
    print(f"near-tie accepted at step {step}: margin {margin:.2e}")
