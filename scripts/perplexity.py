#!/usr/bin/env python3
"""A running server's perplexity on a text, computed as llama.cpp's llama-perplexity computes it, and (with
--llama-perplexity and --gguf) llama-perplexity's own figure on the same file and text, in one run.

The text is tokenized by the server (/tokenize) with the model's BOS in front, as llama-perplexity does, and cut
into chunks of --ctx tokens, each chunk's first token replaced by BOS; each chunk is scored from position 0 in a
fresh row (vLLM's prompt_logprobs on /v1/completions) and only its second half counts: the log-probs at positions
ctx/2 .. ctx-2 of the tokens after them. Bounded: --chunks chunks, loopback only.

    python scripts/perplexity.py --url http://127.0.0.1:8000 --chunks 3 \\
        --llama-perplexity ~/.cache/llama-server-peer/llama-perplexity --gguf model.gguf
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from pathlib import Path

import requests

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "english.txt"


def chunks(url: str, model: str, text: str, ctx: int, count: int) -> list[list[int]]:
    """llama-perplexity's chunks: the text's tokens after BOS (where the model adds one), ctx at a time, each
    chunk's first token BOS."""
    tokenize = lambda s, special: requests.post(  # noqa: E731
        f"{url}/tokenize", json={"model": model, "prompt": s, "add_special_tokens": special}, timeout=120
    ).json()["tokens"]
    marked, plain = tokenize("The", True), tokenize("The", False)
    bos = marked[: len(marked) - len(plain)]  # what the model's tokenizer puts in front (BOS, or nothing)
    ids = bos + tokenize(text, False)
    found = [ids[c * ctx : (c + 1) * ctx] for c in range(min(count, len(ids) // ctx))]
    if not found:
        raise SystemExit(f"the text holds {len(ids)} tokens: fewer than one chunk of {ctx}")
    return [bos + chunk[1:] if bos else chunk for chunk in found]


def server_perplexity(url: str, ctx: int, count: int, text: str) -> tuple[float, int]:
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    nll, n = 0.0, 0
    for chunk in chunks(url, model, text, ctx, count):
        body = {"model": model, "prompt": chunk, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
        scored = requests.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]["prompt_logprobs"]
        for pos in range(ctx // 2 + 1, ctx):  # the token at pos, predicted from pos - 1 (ctx/2 .. ctx-2)
            entry = scored[pos]
            nll -= entry[str(chunk[pos])]["logprob"] if isinstance(entry, dict) else entry
            n += 1
    return math.exp(nll / n), n


def llama_perplexity(binary: str, gguf: str, ctx: int, count: int, text_file: Path) -> float:
    out = subprocess.run(
        [binary, "-m", gguf, "-f", str(text_file), "-c", str(ctx), "--chunks", str(count), "-t", "2"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if found is None:
        raise SystemExit("llama-perplexity printed no final estimate:\n" + (out.stdout + out.stderr)[-2000:])
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity, to run on --gguf too")
    parser.add_argument("--gguf", help="the GGUF the server serves (for --llama-perplexity)")
    args = parser.parse_args()
    text = args.text.read_text()
    ppl, n = server_perplexity(args.url, args.ctx, args.chunks, text)
    print(f"server: PPL {ppl:.4f} over {n} positions ({args.chunks} chunks of {args.ctx})")
    if args.llama_perplexity and args.gguf:
        ref = llama_perplexity(args.llama_perplexity, args.gguf, args.ctx, args.chunks, args.text)
        print(f"llama-perplexity: PPL {ref:.4f}; server {(ppl / ref - 1) * 100:+.2f} %")


if __name__ == "__main__":
    main()
