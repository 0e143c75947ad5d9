#!/usr/bin/env python3
"""Benchmark a running server: N concurrent streaming clients on loopback, bounded in count and time.

Prints aggregate output tokens/s, time to first token and inter-token latency (p50, p99) per concurrency,
and the engine process's resident memory (now and peak).
With --baseline it also times transformers' generate in-process on the same model and prompts (batch 1,
and one static batch of 32) and prints the ratios. With --peer-url it drives another OpenAI-compatible
server (llama.cpp's llama-server, say) with the same prompts, interleaved, and prints our ratio to it at
every concurrency; --api openai streams /v1/completions from both (the default with a peer), native
streams /predictions. With --proxy-url it runs the same load through the
JWT proxy too and prints the overhead. With --repeat N every load runs N times, server and generate runs
interleaved, and the medians are reported (a shared 2-core machine is noisy). With --offline it also runs the
same prompts through the offline Python API (``LLM.chat``) on an engine of its own with the server's model and
rows, and prints its throughput next to the HTTP figure. With --fill-context it ends by filling every row's
whole context at once (one long prompt per row) and prints the engine's memory then: the worst case of the
lazily resident KV cache. The same prompts go out in every run, which servers with a prompt cache (this one,
llama-server) answer without computing them again; --fresh-prompts starts every prompt with a tag never
sent before, so that no server finds any of it cached. --ignore-eos makes every stream run to --max-tokens on
both servers (answers that end early make tokens/s lean on the time to first token).

    python scripts/bench.py --url http://127.0.0.1:8000 --baseline --offline --repeat 3
"""
from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import requests

SUBJECTS = ["the ocean", "a robot's first day", "ancient Rome", "how bread is made", "a winter forest",
            "learning the violin", "the moon landing", "coffee farming", "a city library", "mountain climbing",
            "a curious cat", "summer rain", "steam trains", "the game of chess", "a rooftop garden", "desert life"]


def prompts(n: int, run: int | None = None) -> list[str]:
    """The essay prompts; with a run number each starts with a tag of its own (a hash of run and index, so
    tags part in their first characters), and no server finds any of it in a prompt cache (--fresh-prompts)."""
    tags = [f"[{(run * 1000 + i) * 2654435761 % 2**32:08x}] " if run is not None else "" for i in range(n)]
    return [f"{tags[i]}Write a long, detailed essay about {SUBJECTS[i % len(SUBJECTS)]} (part {i})." for i in range(n)]


@dataclass
class Stream:
    start: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    error: str | None = None


def openai_stream(url: str, model: str, prompt: str, max_tokens: int, headers: dict, out: Stream,
                  extra: dict | None = None) -> None:
    """A /v1/completions stream (raw prompt, greedy); each event that carries text is one arrival."""
    import json

    out.start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True} | (extra or {})
    try:
        with requests.post(f"{url}/v1/completions", headers=headers, stream=True, timeout=300, json=body) as r:
            if r.status_code != 200:
                out.error = f"{r.status_code}: {r.text[:200]}"
                return
            pieces = []
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = choices[0].get("text") or ""
                if text:
                    out.arrivals.append(time.perf_counter())
                    pieces.append(text)
            out.text = "".join(pieces)
    except (requests.RequestException, ValueError) as exc:
        out.error = str(exc)


def native_stream(url: str, model: str, prompt: str, max_tokens: int, headers: dict, out: Stream) -> None:
    out.start = time.perf_counter()
    try:
        with requests.post(f"{url}/predictions/{model}", headers=headers, stream=True, timeout=300,
                           json={"text": prompt, "temperature": 0, "max_tokens": max_tokens}) as r:
            if r.status_code != 200:
                out.error = f"{r.status_code}: {r.text[:200]}"
                return
            pieces = []
            for chunk in r.raw.read_chunked(decode_content=False):
                out.arrivals.append(time.perf_counter())
                pieces.append(chunk)
            out.text = b"".join(pieces).decode("utf-8", "replace")
    except requests.RequestException as exc:
        out.error = str(exc)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_load(url: str, model: str, concurrency: int, max_tokens: int, count_tokens, headers=None,
             api: str = "native", texts: list[str] | None = None, extra: dict | None = None) -> dict:
    streams = [Stream() for _ in range(concurrency)]
    one_stream = functools.partial(openai_stream, extra=extra) if api == "openai" else native_stream
    threads = [threading.Thread(target=one_stream, args=(url, model, p, max_tokens, headers or {}, s))
               for p, s in zip(texts or prompts(concurrency), streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.perf_counter() - started
    errors = [s.error for s in streams if s.error]
    tokens = sum(count_tokens(s.text) for s in streams)
    ttft = [s.arrivals[0] - s.start for s in streams if s.arrivals]
    itl = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    return dict(concurrency=concurrency, tokens=tokens, seconds=elapsed, tps=tokens / elapsed, errors=len(errors),
                ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99), itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99),
                first_error=errors[0] if errors else None)


def print_row(label: str, r: dict) -> None:
    print(f"{label:<22} c={r['concurrency']:<3} {r['tokens']:>6} tok {r['seconds']:7.2f}s {r['tps']:8.1f} tok/s  "
          f"TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms p99 {r['ttft_p99'] * 1e3:7.1f} ms  "
          f"ITL p50 {r['itl_p50'] * 1e3:6.1f} ms p99 {r['itl_p99'] * 1e3:6.1f} ms"
          + (f"  ERRORS {r['errors']}: {r['first_error']}" if r["errors"] else ""))


class Baseline:
    """transformers generate, greedy, in this process, on the same model and prompts as the server load."""

    def __init__(self, model_dir: str, max_tokens: int, chat: bool = True):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.max_tokens, self.chat = torch, max_tokens, chat
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.tok.pad_token = self.tok.pad_token or self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    def run(self, batch: int) -> float:
        """Output tokens per second of one static batch."""
        texts = [self.tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) if self.chat else p
                 for p in prompts(batch)]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=self.max_tokens, do_sample=False,
                                      pad_token_id=self.tok.pad_token_id)
        elapsed = time.perf_counter() - started
        tokens = 0
        for row in out[:, enc.input_ids.shape[1]:].tolist():  # up to and including the end token, as the server
            tokens += next((i + 1 for i, t in enumerate(row) if t == self.eos), len(row))
        print(f"{'generate (in-process)':<22} b={batch:<3} {tokens:>6} tok {elapsed:7.2f}s {tokens / elapsed:8.1f} tok/s")
        return tokens / elapsed


class Offline:
    """The offline Python API in this process: its own engine, with the server's model, rows, context and
    precision (the embedded default model when the server serves it, else the server's model folder)."""

    def __init__(self, health: dict, max_tokens: int, chat: bool):
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from inference_api import LLM, SamplingParams
        from inference_api.config import DEFAULT_MODEL_NAME

        options = dict(rows=health["rows_total"], context_length=health["context_length"])
        if health.get("mock"):
            options["mock"] = True  # at the mock's default rate
        else:
            options.update(model=None if health["model"] == DEFAULT_MODEL_NAME else health["model_dir"],
                           quantize=health["quantize"], kv_dtype=health["kv_dtype"],
                           # bfloat16 batch matmuls and int8 one-row inputs come from --dtype auto
                           dtype="auto" if health.get("int8_inputs") or health.get("matmul_dtype") not in
                           (None, "", health["dtype"]) else health["dtype"])
        self.llm = LLM(**options)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)
        self.chat = chat

    def run(self, concurrency: int) -> dict:
        """The load's prompts all at once, through the chat template when the HTTP load uses /predictions."""
        started = time.perf_counter()
        if self.chat:
            results = self.llm.chat([[{"role": "user", "content": p}] for p in prompts(concurrency)], self.params,
                                    use_tqdm=False)
        else:
            results = self.llm.generate(prompts(concurrency), self.params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(r.completion_tokens for r in results)
        return dict(concurrency=concurrency, tokens=tokens, seconds=elapsed, tps=tokens / elapsed, errors=0)


def print_offline(r: dict) -> None:
    print(f"{'offline (Python API)':<22} c={r['concurrency']:<3} {r['tokens']:>6} tok {r['seconds']:7.2f}s "
          f"{r['tps']:8.1f} tok/s")


def token_counter(health: dict, max_tokens: int):
    """Output tokens of one streamed answer: the mock's tokens are bytes; for a model, the re-encoded text
    plus the end token, never more than were asked for (an answer cut by max_tokens has no end token)."""
    if health.get("mock", False):
        return lambda text: len(text.encode())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(health["model_dir"])
    return lambda text: min(len(tokenizer.encode(text, add_special_tokens=False)) + 1, max_tokens)


def long_prompt(model_dir: str, length: int) -> str:
    """A raw prompt of at most ``length`` tokens of the model's tokenizer: the essay prompts, repeated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    unit = tokenizer.encode(" ".join(prompts(len(SUBJECTS))) + " ", add_special_tokens=False)
    ids = (unit * (length // len(unit) + 1))[:length]
    while len(tokenizer.encode(text := tokenizer.decode(ids), add_special_tokens=False)) > length:
        ids = ids[:-8]  # decoding and encoding again may merge differently
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--baseline", action="store_true", help="also time transformers generate in-process")
    ap.add_argument("--offline", action="store_true", help="also run the prompts through the offline Python API")
    ap.add_argument("--proxy-url", help="also run the load through this JWT proxy")
    ap.add_argument("--jwt-secret", help="secret to sign the proxy's token (default: JWT_SECRET)")
    ap.add_argument("--repeat", type=int, default=1, help="run every load this many times; report medians")
    ap.add_argument("--peer-url", help="also drive this OpenAI-compatible server (e.g. llama-server) the same way")
    ap.add_argument("--peer-pid", type=int, help="the peer's process id, to print its resident memory")
    ap.add_argument("--fill-context", action="store_true",
                    help="finally fill every row's context at once and print the engine's memory then")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="start every prompt with a tag never sent before, so no prompt cache holds any of it")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="send ignore_eos (vLLM's and llama-server's extra; --api openai): every stream runs to "
                         "--max-tokens, so both servers generate the same number of tokens")
    ap.add_argument("--api", choices=["native", "openai"], help="native: /predictions; openai: /v1/completions "
                    "(default: openai with --peer-url, else native)")
    args = ap.parse_args()
    api = args.api or ("openai" if args.peer_url else "native")
    if args.ignore_eos and api != "openai":
        sys.exit("--ignore-eos needs --api openai")
    extra = {"ignore_eos": True} if args.ignore_eos else None
    for u in filter(None, [args.url, args.proxy_url, args.peer_url]):
        host = urlparse(u).hostname or ""
        if not (host == "localhost" or host.startswith("127.") or host == "::1"):
            sys.exit(f"refusing to load a non-loopback address: {u}")

    health = requests.get(args.url + "/health", timeout=10).json()
    model = health["model"]
    print(f"server {args.url}: model {model}, {health['rows_total']} rows")
    count = token_counter(health, args.max_tokens)

    headers = proxy_headers(args.jwt_secret) if args.proxy_url else {}
    base = Baseline(health["model_dir"], args.max_tokens, chat=api == "native") if args.baseline else None
    offline = Offline(health, args.max_tokens, chat=api == "native") if args.offline else None
    pairs = {1: 1, 32: 32}  # server concurrency -> generate batch it is compared with
    run_load(args.url, model, 2, 4, count, api=api)  # warm-up
    if args.peer_url:
        run_load(args.peer_url, model, 2, 4, count, api="openai")
    if offline:
        offline.run(2)
    direct, proxied, generated, peer = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    embedded = defaultdict(list)
    runs = itertools.count()

    def texts(n: int) -> list[str]:
        return prompts(n, next(runs) if args.fresh_prompts else None)

    for _ in range(args.repeat):  # interleaved, so a noisy machine slows both sides of a ratio alike
        for c in args.concurrency:
            direct[c].append(run_load(args.url, model, c, args.max_tokens, count, api=api, texts=texts(c),
                                      extra=extra))
            print_row("server (HTTP stream)", direct[c][-1])
            if args.peer_url:
                peer[c].append(run_load(args.peer_url, model, c, args.max_tokens, count, api="openai",
                                        texts=texts(c), extra=extra))
                print_row("peer", peer[c][-1])
            if args.proxy_url:
                proxied[c].append(run_load(args.proxy_url, model, c, args.max_tokens, count, headers, api=api,
                                           texts=texts(c), extra=extra))
                print_row("through proxy", proxied[c][-1])
            if offline:
                embedded[c].append(offline.run(c))
                print_offline(embedded[c][-1])
            if base and c in pairs:
                generated[pairs[c]].append(base.run(pairs[c]))

    print(f"\nmedians of {args.repeat} run(s):")
    for c in args.concurrency:
        d = median_row(direct[c])
        print_row("server (HTTP stream)", d)
        if args.proxy_url:
            r = median_row(proxied[c])
            print_row("through proxy", r)
            print(f"{'  proxy overhead':<22} c={c:<3} TTFT p50 {(r['ttft_p50'] - d['ttft_p50']) * 1e3:+.1f} ms, "
                  f"throughput {r['tps'] / d['tps']:.3f}x")
        if args.peer_url:
            p = median_row(peer[c])
            print_row("peer", p)
            print(f"ratio: server c={c} / peer c={c} = {d['tps']:.1f} / {p['tps']:.1f} = {d['tps'] / p['tps']:.2f}")
        if offline:
            o = median_row(embedded[c])
            print_offline(o)
            print(f"ratio: offline c={c} / server c={c} = {o['tps']:.1f} / {d['tps']:.1f} = {o['tps'] / d['tps']:.2f}")
        if c in pairs and generated[pairs[c]]:
            g = statistics.median(generated[pairs[c]])
            print(f"ratio: server c={c} / generate b={pairs[c]} = {d['tps']:.1f} / {g:.1f} = {d['tps'] / g:.2f}")
    for label, pid in (("engine", health.get("backend_pid")), ("peer", args.peer_pid)):
        memory = process_memory(pid)
        if memory:
            print(f"{label} memory: {memory}")
    if args.fill_context and not health.get("mock"):
        rows, length = health["rows_total"], health["context_length"]
        text = long_prompt(health["model_dir"], length - 40)  # with 8 new tokens, each row ends near its length
        print_row("every row's context", run_load(args.url, model, rows, 8, count, api="openai", texts=[text] * rows))
        print(f"engine memory, every row's context filled: {process_memory(health.get('backend_pid'))}")
    if offline:
        offline.llm.close()


def process_memory(pid: int | None) -> str | None:
    """A process's resident memory now and at its peak (servers run on this host: loopback)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (TypeError, OSError):
        return None
    kib = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M))
    return f"{int(kib['VmRSS']) / 2**20:.2f} GiB resident, peak {int(kib['VmHWM']) / 2**20:.2f} GiB"


def median_row(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs of one load."""
    row = {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v) for k, v in runs[-1].items()}
    return {**row, "errors": sum(r["errors"] for r in runs)}


def proxy_headers(secret: str | None) -> dict[str, str]:
    import jwt

    token = jwt.encode({"team_id": "bench", "token_id": "bench"}, secret or os.environ["JWT_SECRET"], algorithm="HS256")
    return {"Authorization": f"Bearer {token}"}


if __name__ == "__main__":
    main()
