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
lazily resident KV cache. With --prefill N it times a fresh N-token prompt answered with one token (the prefill
alone) on the server and the peer. The same prompts go out in every run, which servers with a prompt cache (this one,
llama-server) answer without computing them again; --fresh-prompts starts every prompt with a tag never
sent before, so that no server finds any of it cached. --ignore-eos makes every stream run to --max-tokens on
both servers (answers that end early make tokens/s lean on the time to first token). With --adapters A B ..., each
load runs again spread over those LoRA adapters (model names of a server started with --lora), against the base
alone. With --switch, on a server
of several models, it times a switch to each model beside the first: the first token of a request that loads it,
against the load time the server measured and the same request once loaded.

Step time per row count: the server's /metrics count the engine's decode steps (steps with no prompt chunk) and
their seconds by how many rows they decoded (1, 2, 3-4, 5-8, ...); each load's share of them is printed after
its row, and the medians' section gives the mean step time per row count over all runs of a concurrency.

One stream at the memory bound: decoding one row reads every weight once per token, so its ceiling is the
machine's read bandwidth. With a one-stream load (concurrency 1) it prints the bytes each decode step reads,
from the GGUF being served (--gguf; default: the embedded model's file when the server serves it), the GB/s
that makes at the measured tokens/s, a read-bandwidth probe taken in this process at the start and the end
of the run, and the resulting ceiling in tokens/s and the fraction of it reached, for our server and the peer.

Speculative decoding: --grounded runs the input-grounded tasks (rewrite a given code file with one change,
extract fields from a given text, summarize quoting the source: GROUNDED) one stream at a time through
/v1/chat/completions, greedy, on the server with speculation (its default), on the server with the request's
``speculative: false`` (speculation off, the same tokens), and on the peer (start llama-server with its best
``--spec-type`` for the file), interleaved; it prints each side's decode tokens/s (from the first token to the
last), the ratios, and the server's draft acceptance from its /metrics. --spec-plain times the plain essay
prompts with and without speculation (never slower is the goal).

    python scripts/bench.py --url http://127.0.0.1:8000 --baseline --offline --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import requests

SUBJECTS = [
    "the ocean",
    "a robot's first day",
    "ancient Rome",
    "how bread is made",
    "a winter forest",
    "learning the violin",
    "the moon landing",
    "coffee farming",
    "a city library",
    "mountain climbing",
    "a curious cat",
    "summer rain",
    "steam trains",
    "the game of chess",
    "a rooftop garden",
    "desert life",
]


ROOT = Path(__file__).resolve().parent.parent


def use_repo() -> None:
    """The checkout's inference_api importable from this script (run by its path, not as a module)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


EXTRACT_SOURCE = """\
From: Dana Whitfield <dana.whitfield@harbor-freight-lines.example>
Date: 14 March 2026
Subject: Delayed container HFLU 4471938

Dear Mr. Okafor,

Container HFLU 4471938, booked under order 88-20417 for 1,240 cartons of ceramic tiles, left Valencia on the
MV Northern Lark on 2 March and was due in Rotterdam on 9 March. A crane failure at the Valencia terminal held
the vessel for five days, so the new arrival date is 14 March, and the container will be released to your
haulier, Van Dijk Transport, on 16 March. The demurrage of EUR 1,350 for the delay will not be charged to you.
Please quote reference CLM-5521 in any correspondence about this shipment.

Kind regards,
Dana Whitfield, Customer Operations
"""

SUMMARY_SOURCE = """\
The lighthouse at Skerry Point was built in 1874 after three ships were lost on the reef in a single winter.
Its first keeper, Thomas Baird, kept a log of every vessel that passed; the log survives and records 11,402
ships over 31 years. The tower is 38 metres tall and its light, originally a paraffin lamp behind a Fresnel lens,
could be seen 22 nautical miles away. In 1951 the lamp was replaced by an electric light, and in 1988 the station
was automated and the last keeper left. Today the keeper's cottage is a small museum, open from April to
October, which displays the original lens and a copy of Baird's log.
"""


def grounded_tasks() -> list[tuple[str, list[dict]]]:
    """The input-grounded tasks: the answer copies much of the input, which prompt lookup drafts."""
    code = (ROOT / "inference_api" / "engine" / "stopping.py").read_text()
    return [
        (
            "rewrite code",
            [
                {
                    "role": "user",
                    "content": "Rewrite this Python file with the function held_back renamed to held_suffix "
                    "everywhere. Reply with the whole file and nothing else.\n\n" + code,
                }
            ],
        ),
        (
            "extract fields",
            [
                {
                    "role": "user",
                    "content": "From this email, list the container number, the order number, the vessel, the "
                    "new arrival date, the haulier, the demurrage and the reference, one per line as "
                    "'field: value', quoting the email's words.\n\n" + EXTRACT_SOURCE,
                }
            ],
        ),
        (
            "summarize quoting",
            [
                {
                    "role": "user",
                    "content": "Summarize this text in three sentences, quoting its own words where you can.\n\n"
                    + SUMMARY_SOURCE,
                }
            ],
        ),
    ]


def chat_timed(url: str, model: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed greedy chat answer: its tokens (the usage), time to the first token, decode tokens/s from
    the first token to the last, and the text."""
    import json

    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | (extra or {})
    started = time.perf_counter()
    first = last = None
    pieces, tokens = [], 0
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    last = time.perf_counter()
                    first = first or last
                    pieces.append(text)
    if first is None or last is None:
        return dict(tokens=0, ttft=float("nan"), tps=float("nan"), text="")
    span = last - first
    return dict(
        tokens=tokens, ttft=first - started, tps=(tokens - 1) / span if span > 0 else float("nan"), text="".join(pieces)
    )


def spec_counts(url: str) -> tuple[float, float]:
    """The server's drafted and accepted tokens so far (its /metrics)."""
    text = requests.get(url + "/metrics", timeout=10).text
    found = dict(re.findall(r"^inference_spec_(drafted|accepted)_tokens_total (\S+)$", text, re.M))
    return float(found.get("drafted", 0)), float(found.get("accepted", 0))


def grounded(url: str, peer_url: str | None, model: str, max_tokens: int, repeat: int) -> None:
    """--grounded: each task on the server (speculation on, then off) and the peer, interleaved; medians."""
    print(
        f"\ninput-grounded tasks, one stream, greedy, max_tokens {max_tokens} (decode tokens/s, first to last token):"
    )
    sides = [("spec on", url, None), ("spec off", url, {"speculative": False})]
    if peer_url:
        sides.append(("peer", peer_url, None))
    for name, messages in grounded_tasks():
        runs: dict[str, list[dict]] = defaultdict(list)
        drafted = accepted = 0.0
        for _ in range(max(1, repeat)):
            for label, u, extra in sides:
                before = spec_counts(url) if label == "spec on" else None
                runs[label].append(chat_timed(u, model, messages, max_tokens, extra))
                if before is not None:
                    after = spec_counts(url)
                    drafted += after[0] - before[0]
                    accepted += after[1] - before[1]
        tps = {label: statistics.median(r["tps"] for r in rs) for label, rs in runs.items()}
        same = runs["spec on"][-1]["text"] == runs["spec off"][-1]["text"]
        line = ", ".join(f"{label} {v:.1f}" for label, v in tps.items())
        print(f"  {name:<18} tokens {runs['spec on'][-1]['tokens']:>4}: {line}")
        ratios = f"on/off {tps['spec on'] / tps['spec off']:.2f}x"
        if "peer" in tps:
            ratios += f", on/peer {tps['spec on'] / tps['peer']:.2f}x"
        rate = accepted / drafted if drafted else float("nan")
        print(f"  {'':<18} {ratios}; acceptance {rate:.2f} ({accepted:.0f}/{drafted:.0f}); same text as off: {same}")


def spec_plain(url: str, model: str, concurrency: list[int], max_tokens: int, count, repeat: int) -> None:
    """--spec-plain: the essay prompts with speculation on and off (the request's switch), interleaved."""
    print("\nplain prompts, speculation on against off:")
    for c in concurrency:
        on, off = [], []
        for _ in range(max(1, repeat)):
            on.append(run_load(url, model, c, max_tokens, count, api="openai")["tps"])
            off.append(run_load(url, model, c, max_tokens, count, api="openai", extra={"speculative": False})["tps"])
        a, b = statistics.median(on), statistics.median(off)
        print(f"  c={c:<3} on {a:.1f}, off {b:.1f} tokens/s: {a / b:.3f}x")


def returning(model: str | None, length: int, others: int, rows: int) -> None:
    """--returning: a conversation of about ``length`` tokens comes back after ``others`` other conversations have
    passed through every row; its next turn's first token, cold (a conversation never seen), from the prompt cache
    in memory, and after a restart from the prompt cache on disk. On servers this starts itself on loopback (the
    default model, or ``model``), with ``--prompt-cache-dir`` in a temporary folder."""
    import signal
    import socket
    import subprocess
    import tempfile

    def start(folder: str) -> tuple[subprocess.Popen, str]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = [sys.executable, "-m", "inference_api", "--port", str(port), "--prompt-cache-dir", folder]
        argv += ["--rows", str(rows), "--context-length", "4096"] + (["--model", model] if model else [])
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except requests.RequestException:
                pass
            time.sleep(0.5)
        proc.kill()
        sys.exit("--returning: the server did not start")

    def stop(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)  # a drain: the engine saves its rows' caches to the folder
        proc.wait(120)

    def turn(url: str, name: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
        started = time.perf_counter()
        r = requests.post(
            f"{url}/v1/chat/completions",
            json={"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
            timeout=600,
        )
        r.raise_for_status()
        return time.perf_counter() - started, r.json()["choices"][0]["message"]["content"]

    def conversation(tag: str, text: str) -> list[dict]:
        return [{"role": "user", "content": f"[{tag}] {text}\nSummarize the text above in one sentence."}]

    with tempfile.TemporaryDirectory() as folder:
        proc, url = start(folder)
        try:
            health = requests.get(url + "/health", timeout=10).json()
            name, text = health["model"], long_prompt(health["model_dir"], length)
            firsts = {}
            for tag in ("A", "B", "C"):
                _, answer = turn(url, name, conversation(tag, text), 16)
                firsts[tag] = conversation(tag, text) + [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Now name its subject in two words."},
                ]
            short = prompts(others, run=7)
            for i in range(0, others, rows):  # every row taken by others, several times over
                batch = short[i : i + rows]
                run_load(url, name, len(batch), 8, lambda t: 1, api="openai", texts=[p * 6 for p in batch])
            cold, _ = turn(url, name, conversation("fresh", text) + firsts["A"][1:], 1)
            ram, _ = turn(url, name, firsts["A"], 1)
        finally:
            stop(proc)
        proc, url = start(folder)
        try:
            disk, _ = turn(url, name, firsts["B"], 1)
            cold_after, _ = turn(url, name, conversation("fresh2", text) + firsts["C"][1:], 1)
        finally:
            stop(proc)
    print(f"\nreturning conversation of about {length} tokens after {others} others ({rows} rows), first token:")
    print(f"  cold {cold:.3f} s; from the prompt cache in memory {ram:.3f} s: {cold / ram:.1f}x")
    print(
        f"  after a restart: cold {cold_after:.3f} s; from the prompt cache on disk {disk:.3f} s: "
        f"{cold_after / disk:.1f}x"
    )


def embeddings_bench(url: str, peer_url: str | None, model: str, repeat: int) -> None:
    """--embeddings: texts embedded per second through /v1/embeddings, one client at a time (64 texts) and 32
    concurrent clients (32 texts each: long enough that the clients' start and the last answers weigh little), on
    the server and the peer (llama-server --embedding), interleaved; each client keeping its connection open
    between requests (as the official clients' connection pools do), and, at one client, also a new connection for
    every request."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [
        f"{SUBJECTS[i % len(SUBJECTS)]}: a sentence of about twenty words to embed, number {i}." for i in range(1024)
    ]
    clients, each = 32, 32

    def one(http, u: str, text: str) -> None:
        r = http.post(f"{u}/v1/embeddings", json={"model": model, "input": text}, timeout=120)
        r.raise_for_status()

    def sequential(u: str, fresh: bool = False) -> float:
        started = time.perf_counter()
        with requests.Session() as session:
            for t in texts[:64]:
                one(requests if fresh else session, u, t)
        return 64 / (time.perf_counter() - started)

    def client(u: str, i: int) -> None:
        with requests.Session() as session:
            for t in texts[i * each : (i + 1) * each]:
                one(session, u, t)

    def concurrent(u: str) -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda i: client(u, i), range(clients)))
        return clients * each / (time.perf_counter() - started)

    sides = [("server", url)] + ([("peer", peer_url)] if peer_url else [])
    results: dict[tuple[str, str], list[float]] = defaultdict(list)
    loads = {
        "c=1": sequential,
        "c=32": concurrent,
        "c=1, a new connection a request": functools.partial(sequential, fresh=True),
    }
    for _ in range(max(1, repeat)):
        for label, u in sides:
            for load, run in loads.items():
                results[(label, load)].append(run(u))
    print("\nembeddings, texts per second through /v1/embeddings:")
    for load in loads:
        ours = statistics.median(results[("server", load)])
        line = f"  {load}: server {ours:.1f}"
        if peer_url:
            theirs = statistics.median(results[("peer", load)])
            line += f", peer {theirs:.1f}: {ours / theirs:.2f}x"
        print(line)


def adapter_spread(url: str, model: str, adapters: list[str], concurrency: list[int], max_tokens, count, repeat, extra):
    """--adapters: each load on the base model alone, then spread over these LoRA adapters (model names) in turn,
    interleaved; each side's medians and decode steps, and the ratio of their tokens/s."""
    print(f"\nLoRA adapters: streams on {model} alone against spread over {', '.join(adapters)}:")
    for c in concurrency:
        runs: dict[str, list[dict]] = {"base": [], "adapters": []}
        steps: dict[str, dict[str, list[float]]] = {k: defaultdict(lambda: [0.0, 0.0]) for k in runs}
        for _ in range(max(1, repeat)):
            for side, names in (("base", model), ("adapters", adapters)):
                before = decode_steps(url)
                runs[side].append(run_load(url, names, c, max_tokens, count, api="openai", extra=extra))
                add_steps(steps[side], steps_between(before, decode_steps(url)))
        for side in runs:
            print_row(f"  {side}", median_row(runs[side]))
            print(f"{'    decode steps':<22} c={c:<3} {steps_line(steps[side])}")
        a, b = (statistics.median(r["tps"] for r in runs[side]) for side in ("adapters", "base"))
        print(f"  c={c:<3} adapters {a:.1f}, base {b:.1f} tokens/s: {a / b:.3f}x")


def model_switch(url: str, repeat: int) -> None:
    """--switch: for every model of a server with several (--models-dir, --model again) but the first, unloaded
    (llama-server's /models/unload), a one-token chat request's time to its first token, which loads it, against
    the load time the server measured (its /v1/models status) and the same request once it is loaded: what a
    switch costs beyond loading the model."""
    cards = requests.get(f"{url}/v1/models", timeout=30).json()["data"]
    print(f"\nmodel switch, {len(cards) - 1} models beside the first, {max(1, repeat)} run(s) each (medians):")
    messages = [{"role": "user", "content": "Say hi."}]
    for card in cards[1:]:
        name = card["id"]
        cold, loads, warm = [], [], []
        for _ in range(max(1, repeat)):
            requests.post(f"{url}/models/unload", json={"model": name}, timeout=60).raise_for_status()
            try:
                r = chat_timed(url, name, messages, 1)
            except requests.HTTPError as exc:  # an embedding model, a file that does not load
                r = {"tokens": 0, "why": exc.response.text[:160]}
            if not r["tokens"]:
                print(f"  {name}: no answer ({r.get('why', 'is it a generating model?')})")
                break
            cold.append(r["ttft"])
            loads.append(requests.get(f"{url}/v1/models/{name}", timeout=30).json()["status"]["load_seconds"])
            warm.append(chat_timed(url, name, messages, 1)["ttft"])
        if cold:
            c, load, w = (statistics.median(v) for v in (cold, loads, warm))
            print(
                f"  {name:<28} first token after a switch {c * 1000:8.1f} ms = load {load * 1000:8.1f} ms "
                f"+ loaded {w * 1000:6.1f} ms + {max(0.0, c - load - w) * 1000:6.1f} ms more "
                f"({c / (load + w):.2f}x load + loaded)"
            )


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


def openai_stream(
    url: str, model: str, prompt: str, max_tokens: int, headers: dict, out: Stream, extra: dict | None = None
) -> None:
    """A /v1/completions stream (raw prompt, greedy); each event that carries text is one arrival."""
    import json

    out.start = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True} | (
        extra or {}
    )
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
        with requests.post(
            f"{url}/predictions/{model}",
            headers=headers,
            stream=True,
            timeout=300,
            json={"text": prompt, "temperature": 0, "max_tokens": max_tokens},
        ) as r:
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


def run_load(
    url: str,
    model: str | list[str],
    concurrency: int,
    max_tokens: int,
    count_tokens,
    headers=None,
    api: str = "native",
    texts: list[str] | None = None,
    extra: dict | None = None,
) -> dict:
    streams = [Stream() for _ in range(concurrency)]
    one_stream = functools.partial(openai_stream, extra=extra) if api == "openai" else native_stream
    models = [model] if isinstance(model, str) else model  # several: the streams spread over them in turn
    threads = [
        threading.Thread(target=one_stream, args=(url, models[i % len(models)], p, max_tokens, headers or {}, s))
        for i, (p, s) in enumerate(zip(texts or prompts(concurrency), streams))
    ]
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
    return dict(
        concurrency=concurrency,
        tokens=tokens,
        seconds=elapsed,
        tps=tokens / elapsed,
        errors=len(errors),
        ttft_p50=pct(ttft, 0.5),
        ttft_p99=pct(ttft, 0.99),
        itl_p50=pct(itl, 0.5),
        itl_p99=pct(itl, 0.99),
        itl_max=max(itl, default=float("nan")),
        first_error=errors[0] if errors else None,
    )


def decode_steps(url: str) -> dict[str, tuple[float, float]]:
    """The server's inference_engine_decode_step_seconds: {rows: (steps, seconds)} so far."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    steps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(text):
        if family.name == "inference_engine_decode_step_seconds":
            for s in family.samples:
                if s.name.endswith("_count"):
                    steps[s.labels["rows"]][0] = s.value
                elif s.name.endswith("_sum"):
                    steps[s.labels["rows"]][1] = s.value
    return {rows: (n, seconds) for rows, (n, seconds) in steps.items()}


def steps_between(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """The decode steps taken between two readings of decode_steps, by rows."""
    grown = {rows: (n - before.get(rows, (0, 0))[0], s - before.get(rows, (0, 0))[1]) for rows, (n, s) in after.items()}
    return {rows: v for rows, v in grown.items() if v[0] > 0}


def add_steps(sums: dict[str, list[float]], taken: dict[str, tuple[float, float]]) -> None:
    """Add steps_between's counts and seconds into running sums by rows."""
    for rows, (n, seconds) in taken.items():
        sums[rows][0] += n
        sums[rows][1] += seconds


def steps_line(steps: Mapping[str, Sequence[float]]) -> str:
    """Mean step time per row count: "1 row 9.1 ms (63 steps), 3-4 rows ..."."""
    parts = []
    for rows in sorted(steps, key=lambda rows: int(rows.split("-")[0])):
        n, seconds = steps[rows]
        plural = "" if rows == "1" else "s", "" if n == 1 else "s"
        parts.append(f"{rows} row{plural[0]} {seconds / n * 1e3:.1f} ms ({n:.0f} step{plural[1]})")
    return ", ".join(parts)


def print_row(label: str, r: dict) -> None:
    print(
        f"{label:<22} c={r['concurrency']:<3} {r['tokens']:>6} tok {r['seconds']:7.2f}s {r['tps']:8.1f} tok/s  "
        f"TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms p99 {r['ttft_p99'] * 1e3:7.1f} ms  "
        f"ITL p50 {r['itl_p50'] * 1e3:6.1f} ms p99 {r['itl_p99'] * 1e3:6.1f} ms"
        + (f"  ERRORS {r['errors']}: {r['first_error']}" if r["errors"] else "")
    )


class Baseline:
    """transformers generate, greedy, in this process, on the same model and prompts as the server load."""

    def __init__(self, model_dir: str, max_tokens: int, chat: bool = True, gguf: Path | None = None):
        """The weights come from the model folder, or from the GGUF file (dequantized by transformers) when
        the folder holds none (the server reads a GGUF's weights straight from the file)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.max_tokens, self.chat = torch, max_tokens, chat
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.tok.pad_token = self.tok.pad_token or self.tok.eos_token
        weights = any(next(Path(model_dir).glob(pattern), None) for pattern in ("*.safetensors", "*.bin"))
        where = dict(pretrained_model_name_or_path=model_dir)
        if not weights and gguf is not None:
            where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
        self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    def run(self, batch: int) -> float:
        """Output tokens per second of one static batch."""
        texts = [
            self.tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            if self.chat
            else p
            for p in prompts(batch)
        ]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_tokens, do_sample=False, pad_token_id=self.tok.pad_token_id
            )
        elapsed = time.perf_counter() - started
        tokens = 0
        for row in out[:, enc.input_ids.shape[1] :].tolist():  # up to and including the end token, as the server
            tokens += next((i + 1 for i, t in enumerate(row) if t == self.eos), len(row))
        print(
            f"{'generate (in-process)':<22} b={batch:<3} {tokens:>6} tok {elapsed:7.2f}s {tokens / elapsed:8.1f} tok/s"
        )
        return tokens / elapsed


class Offline:
    """The offline Python API in this process: its own engine, with the server's model, rows, context and
    precision (the embedded default model when the server serves it, else the server's model folder)."""

    def __init__(self, health: dict, max_tokens: int, chat: bool):
        use_repo()
        from inference_api import LLM, SamplingParams
        from inference_api.config import DEFAULT_MODEL_NAME

        options = dict(rows=health["rows_total"], context_length=health["context_length"])
        if health.get("mock"):
            options["mock"] = True  # at the mock's default rate
        else:
            options.update(
                model=None if health["model"] == DEFAULT_MODEL_NAME else health["model_dir"],
                quantize=health["quantize"],
                kv_dtype=health["kv_dtype"],
                # bfloat16 batch matmuls and int8 one-row inputs come from --dtype auto
                dtype="auto"
                if health.get("int8_inputs") or health.get("matmul_dtype") not in (None, "", health["dtype"])
                else health["dtype"],
            )
        self.llm = LLM(**options)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)
        self.chat = chat

    def run(self, concurrency: int) -> dict:
        """The load's prompts all at once, through the chat template when the HTTP load uses /predictions."""
        started = time.perf_counter()
        if self.chat:
            results = self.llm.chat(
                [[{"role": "user", "content": p}] for p in prompts(concurrency)], self.params, use_tqdm=False
            )
        else:
            results = self.llm.generate(prompts(concurrency), self.params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(r.completion_tokens for r in results)
        return dict(concurrency=concurrency, tokens=tokens, seconds=elapsed, tps=tokens / elapsed, errors=0)


def print_offline(r: dict) -> None:
    print(
        f"{'offline (Python API)':<22} c={r['concurrency']:<3} {r['tokens']:>6} tok {r['seconds']:7.2f}s "
        f"{r['tps']:8.1f} tok/s"
    )


def token_counter(health: dict, max_tokens: int):
    """Output tokens of one streamed answer: the mock's tokens are bytes; for a model, the re-encoded text
    plus the end token, never more than were asked for (an answer cut by max_tokens has no end token)."""
    if health.get("mock", False):
        return lambda text: len(text.encode())
    use_repo()
    from inference_api.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(health["model_dir"])  # (the server's own: the same ids)
    return lambda text: min(len(tokenizer.encode(text, add_special_tokens=False)) + 1, max_tokens)


def long_prompt(model_dir: str, length: int) -> str:
    """A raw prompt of at most ``length`` tokens of the model's tokenizer: the essay prompts, repeated."""
    use_repo()
    from inference_api.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    unit = tokenizer.encode(" ".join(prompts(len(SUBJECTS))) + " ", add_special_tokens=False)
    ids = (unit * (length // len(unit) + 1))[:length]
    while len(tokenizer.encode(text := tokenizer.decode(ids), add_special_tokens=False)) > length:
        ids = ids[:-8]  # decoding and encoding again may merge differently
    return text


def gguf_tensors(path: str | Path) -> tuple[dict, object | None]:
    """The GGUF's tensors by name, and its token embedding table when a step reads only one row of it (the file has
    an ``output.weight``); None when the table is the output head too (tied embeddings), read whole."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    return tensors, tensors.get("token_embd.weight") if "output.weight" in tensors else None


def decode_bytes(path: str | Path) -> int:
    """Bytes of the GGUF's weights one decode step of one row reads: every tensor once, except an untied token
    embedding table (``gguf_tensors``), of which the step reads one row (its token)."""
    tensors, lookup = gguf_tensors(path)
    total = sum(int(t.n_bytes) for t in tensors.values())
    if lookup is not None:
        rows = math.prod(int(n) for n in lookup.shape[1:]) or 1  # the shape lists ne0 (a row's length) first
        total -= int(lookup.n_bytes) - int(lookup.n_bytes) // rows
    return total


def linear_weights(path: str | Path) -> int:
    """The weights one token multiplies in the GGUF's linears (its multiply-adds a token, attention's own products
    left out): every tensor of two or more dimensions but an untied token embedding table (``gguf_tensors``)."""
    tensors, lookup = gguf_tensors(path)
    return sum(int(t.n_elements) for t in tensors.values() if len(t.shape) > 1 and t is not lookup)


def compute_probe(health: dict, seconds: float = 0.5) -> float | None:
    """The int8 multiply-adds a second the server's kernel level can issue on every core (the kernels'
    ``int8_peak``: the tiles' instruction alone, no memory traffic), the best of a few runs; printed. The ceiling of
    a compute-bound step such as a long prefill. None when the kernels cannot be loaded here (never fails the run)."""
    try:
        use_repo()
        from inference_api.config import ServerConfig
        from inference_api.kernels import load_kernels

        build = str(health.get("kernels") or "")
        level = None if build.startswith("native") else build.split()[-1]
        kernels = load_kernels(ServerConfig().model_cache_dir, level=level)
        with every_core():
            steps = 1 << 16
            while True:  # steps enough for about a tenth of the budget a run
                started = time.perf_counter()
                kernels.int8_peak(steps)
                if time.perf_counter() - started > seconds / 10:
                    break
                steps *= 4
            best = max(kernels.int8_peak(steps) for _ in range(5))
    except Exception as exc:  # noqa: BLE001 - a figure we cannot compute never fails the run
        print(f"int8 compute probe failed: {type(exc).__name__}: {exc}")
        return None
    print(f"int8 compute probe: {best / 1e9:.1f} G multiply-adds/s with {os.cpu_count()} threads ({kernels.build})")
    return best


def served_gguf(path: str | None, health: dict) -> tuple[Path | None, str]:
    """The GGUF file the servers serve: --gguf, else the embedded model's file when the server serves the
    default model (the mock included); else None, with the reason."""
    if path:
        return Path(path), path
    try:
        use_repo()
        from inference_api.config import DEFAULT_MODEL_NAME
        from inference_api.model.loader import embedded_gguf

        if health.get("model") != DEFAULT_MODEL_NAME:
            return None, f"the server serves {health.get('model')}, not the embedded model: pass --gguf"
        return embedded_gguf(), "the embedded model"
    except Exception as exc:  # noqa: BLE001 - no wheel, or the package not importable: no file, never a failure
        return None, f"{type(exc).__name__}: {exc}"


def step_bytes(gguf: Path | None, note: str) -> int | None:
    """decode_bytes of the served GGUF, printed; None (and a line saying so) when it cannot be read."""
    if gguf is not None:
        try:
            n = decode_bytes(gguf)
            print(f"decode step reads {n / 1e6:.1f} MB of weights per token ({gguf.name})")
            return n
        except Exception as exc:  # noqa: BLE001 - a figure we cannot compute never fails the run
            note = f"{gguf}: {type(exc).__name__}: {exc}"
    print(f"decode step bytes unknown ({note}); the one-stream bandwidth figures are left out")
    return None


def last_level_cache() -> int:
    """The largest CPU cache's size in bytes (0 when the system does not say)."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        m = re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip())
        if m:
            sizes.append(int(m[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m[2]])
    return max(sizes)


def available_memory() -> int:
    try:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) * 1024
    except (OSError, TypeError):
        return 8 * 2**30


def probe_size(model_bytes: int | None) -> int:
    """The probe's buffer: well past the last-level cache and the model (1 GiB, 4x the model, 4x the cache,
    whichever is largest), at most a quarter of the available memory and 8 GiB."""
    want = max(2**30, 4 * (model_bytes or 0), 4 * last_level_cache())
    return max(64 * 2**20, min(want, available_memory() // 4, 8 * 2**30))


@contextlib.contextmanager
def every_core():
    """torch's threads (and so the kernels' parallel regions) on every core of the machine, restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def read_bandwidth(nbytes: int, budget_s: float = 3.0, repeats: int = 5) -> float:
    """GB/s (1e9 bytes a second) reading an nbytes buffer with every core (``every_core``): the best of a few timed
    sums of float32 elements (a read-only stream; the sum's additions cost far less than the loads), stopped once
    the time budget is spent."""
    import torch

    with every_core():
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: every page resident
        buffer.sum()  # warm: threads up, pages in the TLB's reach
        best, spent = 0.0, 0.0
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            elapsed = time.perf_counter() - started
            best, spent = max(best, buffer.numel() * 4 / elapsed / 1e9), spent + elapsed
            if spent > budget_s:
                break
        return best


def probe(model_bytes: int | None, when: str) -> float | None:
    """read_bandwidth printed; None when it cannot run (never fails the run)."""
    size = probe_size(model_bytes)
    try:
        gbps = read_bandwidth(size)
    except Exception as exc:  # noqa: BLE001
        print(f"read-bandwidth probe ({when}) failed: {type(exc).__name__}: {exc}")
        return None
    print(
        f"read-bandwidth probe ({when}): {gbps:.1f} GB/s reading {size / 2**30:.2f} GiB with {os.cpu_count()} threads"
    )
    return gbps


def memory_bound_line(label: str, r: dict, model_bytes: int, bandwidth: float) -> str:
    """One stream against the machine's read bandwidth: bytes a token, the GB/s reached, the ceiling and
    the fraction of it, end to end (tokens/s of the load) and for the decode steps alone (1 / ITL p50)."""
    ceiling = bandwidth * 1e9 / model_bytes
    line = (
        f"one stream, {label}: {model_bytes / 1e6:.1f} MB read per token, {r['tps']:.1f} tok/s = "
        f"{r['tps'] * model_bytes / 1e9:.1f} GB/s of {bandwidth:.1f} GB/s probe "
        f"(ceiling {ceiling:.0f} tok/s, {100 * r['tps'] / ceiling:.0f} % of it)"
    )
    if r.get("itl_p50", 0) > 0 and math.isfinite(r["itl_p50"]):
        steps = 1 / r["itl_p50"]
        line += f"; decode steps alone (1 / ITL p50) {steps:.1f} tok/s = {100 * steps / ceiling:.0f} %"
    return line


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
    ap.add_argument(
        "--fill-context",
        action="store_true",
        help="finally fill every row's context at once and print the engine's memory then",
    )
    ap.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="start every prompt with a tag never sent before, so no prompt cache holds any of it",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (vLLM's and llama-server's extra; --api openai): every stream runs to "
        "--max-tokens, so both servers generate the same number of tokens",
    )
    ap.add_argument(
        "--gguf",
        help="the GGUF file the servers serve, for the bytes a decode step reads "
        "(default: the embedded model's file, when the server serves the embedded model)",
    )
    ap.add_argument(
        "--structured",
        action="store_true",
        help="also run every load with each stream constrained to a JSON schema (response_format), "
        "and time the other streams' tokens while a large schema is compiled (--api openai)",
    )
    ap.add_argument(
        "--flood",
        action="store_true",
        help="finally time a short request's first token (team 'victim') alone and under a flood of long prompts "
        "from another team (X-Team-Id 'flood', straight to the server), the starvation a fair scheduler prevents",
    )
    ap.add_argument(
        "--prefill",
        type=int,
        metavar="N",
        help="finally time a fresh prompt of N tokens answered with one token (the prefill alone), 3 times or "
        "--repeat, on the server and the peer, interleaved; prints the medians and their ratio",
    )
    ap.add_argument(
        "--grounded",
        action="store_true",
        help="finally time the input-grounded tasks one stream at a time: speculation on, off, and the peer",
    )
    ap.add_argument(
        "--returning",
        action="store_true",
        help="finally time a 2,000-token conversation's next turn after 64 others, cold, from the prompt cache in "
        "memory and, after a restart, on disk (on servers of its own: the default model or --gguf)",
    )
    ap.add_argument(
        "--embeddings",
        action="store_true",
        help="time /v1/embeddings instead (an embedding model's server and llama-server --embedding as the peer): "
        "texts per second one at a time and with 32 concurrent clients",
    )
    ap.add_argument(
        "--adapters",
        nargs="+",
        metavar="NAME",
        help="finally time each concurrency's load spread over these LoRA adapters (model names) against the base",
    )
    ap.add_argument(
        "--switch",
        action="store_true",
        help="time a switch to each model of a server with several (unloaded first): first token against load time",
    )
    ap.add_argument(
        "--spec-plain",
        action="store_true",
        help="finally time the plain prompts at each concurrency with speculation on and off",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (--api openai; each server's own defaults for what is not sent) instead of "
        "the greedy answers",
    )
    ap.add_argument("--top-p", type=float, help="with --temperature: the nucleus sent too")
    ap.add_argument(
        "--api",
        choices=["native", "openai"],
        help="native: /predictions; openai: /v1/completions (default: openai with --peer-url, else native)",
    )
    args = ap.parse_args()
    api = args.api or ("openai" if args.peer_url else "native")
    if (args.ignore_eos or args.structured or args.temperature) and api != "openai":
        sys.exit("--ignore-eos, --structured and --temperature need --api openai")
    extra = ({"ignore_eos": True} if args.ignore_eos else {}) | (
        {"temperature": args.temperature} | ({"top_p": args.top_p} if args.top_p is not None else {})
        if args.temperature
        else {}
    ) or None
    for u in filter(None, [args.url, args.proxy_url, args.peer_url]):
        host = urlparse(u).hostname or ""
        if not (host == "localhost" or host.startswith("127.") or host == "::1"):
            sys.exit(f"refusing to load a non-loopback address: {u}")

    health = requests.get(args.url + "/health", timeout=10).json()
    model = health["model"]
    if args.switch:
        print(f"server {args.url}: first model {model}")
        print(cpu_line(health))
        model_switch(args.url, args.repeat)
        return
    if args.embeddings:
        print(f"server {args.url}: model {model}")
        print(cpu_line(health))
        embeddings_bench(args.url, args.peer_url, model, args.repeat)
        return
    print(f"server {args.url}: model {model}, {health['rows_total']} rows")
    print(cpu_line(health))
    count = token_counter(health, args.max_tokens)
    gguf, gguf_note = served_gguf(args.gguf, health)
    one_stream = 1 in args.concurrency
    model_bytes = step_bytes(gguf, gguf_note) if one_stream else None
    if model_bytes and health.get("quantize") == "none" and not health.get("mock"):
        print("  (this server dequantized the file's weights: its steps read more than the file's blocks)")
    bandwidth = [probe(model_bytes, "start")] if one_stream else []

    headers = proxy_headers(args.jwt_secret) if args.proxy_url else {}
    base = Baseline(health["model_dir"], args.max_tokens, chat=api == "native", gguf=gguf) if args.baseline else None
    offline = Offline(health, args.max_tokens, chat=api == "native") if args.offline else None
    pairs = {1: 1, 32: 32}  # server concurrency -> generate batch it is compared with
    run_load(args.url, model, 2, 4, count, api=api)  # warm-up
    if args.peer_url:
        run_load(args.peer_url, model, 2, 4, count, api="openai")
    if offline:
        offline.run(2)
    direct, proxied, generated, peer = defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    constrained = defaultdict(list)
    embedded = defaultdict(list)
    step_sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    runs = itertools.count()

    def texts(n: int) -> list[str]:
        return prompts(n, next(runs) if args.fresh_prompts else None)

    for _ in range(args.repeat):  # interleaved, so a noisy machine slows both sides of a ratio alike
        for c in args.concurrency:
            before = decode_steps(args.url)
            direct[c].append(run_load(args.url, model, c, args.max_tokens, count, api=api, texts=texts(c), extra=extra))
            taken = steps_between(before, decode_steps(args.url))
            print_row("server (HTTP stream)", direct[c][-1])
            print(f"{'  decode steps':<22} c={c:<3} {steps_line(taken)}")
            add_steps(step_sums[c], taken)
            if args.peer_url:
                peer[c].append(
                    run_load(args.peer_url, model, c, args.max_tokens, count, api="openai", texts=texts(c), extra=extra)
                )
                print_row("peer", peer[c][-1])
            if args.proxy_url:
                proxied[c].append(
                    run_load(
                        args.proxy_url, model, c, args.max_tokens, count, headers, api=api, texts=texts(c), extra=extra
                    )
                )
                print_row("through proxy", proxied[c][-1])
            if args.structured:
                constrained[c].append(
                    run_load(
                        args.url,
                        model,
                        c,
                        args.max_tokens,
                        count,
                        api=api,
                        texts=texts(c),
                        extra={**(extra or {}), "response_format": STORY_FORMAT},
                    )
                )
                print_row("constrained (JSON)", constrained[c][-1])
            if offline:
                embedded[c].append(offline.run(c))
                print_offline(embedded[c][-1])
            if base and c in pairs:
                generated[pairs[c]].append(base.run(pairs[c]))

    if one_stream:
        bandwidth.append(probe(model_bytes, "end"))
    bandwidth = max(filter(None, bandwidth), default=None)  # the machine's best: the ceiling
    print(f"\nmedians of {args.repeat} run(s):")
    for c in args.concurrency:
        d = median_row(direct[c])
        print_row("server (HTTP stream)", d)
        if step_sums[c]:
            print(f"{'  decode step time':<22} c={c:<3} {steps_line(step_sums[c])}")
        if args.proxy_url:
            r = median_row(proxied[c])
            print_row("through proxy", r)
            print(
                f"{'  proxy overhead':<22} c={c:<3} TTFT p50 {(r['ttft_p50'] - d['ttft_p50']) * 1e3:+.1f} ms, "
                f"throughput {r['tps'] / d['tps']:.3f}x"
            )
        if args.peer_url:
            p = median_row(peer[c])
            print_row("peer", p)
            print(f"ratio: server c={c} / peer c={c} = {d['tps']:.1f} / {p['tps']:.1f} = {d['tps'] / p['tps']:.2f}")
        if args.structured:
            k = median_row(constrained[c])
            print_row("constrained (JSON)", k)
            print(
                f"ratio: constrained c={c} / unconstrained c={c} = {k['tps']:.1f} / {d['tps']:.1f} = "
                f"{k['tps'] / d['tps']:.2f}"
            )
        if offline:
            o = median_row(embedded[c])
            print_offline(o)
            print(f"ratio: offline c={c} / server c={c} = {o['tps']:.1f} / {d['tps']:.1f} = {o['tps'] / d['tps']:.2f}")
        if c in pairs and generated[pairs[c]]:
            g = statistics.median(generated[pairs[c]])
            print(f"ratio: server c={c} / generate b={pairs[c]} = {d['tps']:.1f} / {g:.1f} = {d['tps'] / g:.2f}")
        if c == 1 and model_bytes and bandwidth:
            print(memory_bound_line("server", d, model_bytes, bandwidth))
            if args.peer_url:
                print(memory_bound_line("peer", median_row(peer[c]), model_bytes, bandwidth))
    for label, pid in (("engine", health.get("backend_pid")), ("peer", args.peer_pid)):
        memory = process_memory(pid)
        if memory:
            print(f"{label} memory: {memory}")
    print_server_memory(health, args.peer_pid)
    if args.structured:
        compile_stall(args.url, model, max(args.concurrency), args.max_tokens, count)
    if args.flood:
        flood_ttft(args.url, model, health)
    if args.grounded:
        grounded(args.url, args.peer_url, model, max(args.max_tokens, 256), args.repeat)
    if args.returning:
        returning(args.gguf, 2000, 64, health["rows_total"])
    if args.spec_plain:
        spec_plain(args.url, model, args.concurrency, args.max_tokens, count, args.repeat)
    if args.adapters:
        adapter_spread(args.url, model, args.adapters, args.concurrency, args.max_tokens, count, args.repeat, extra)
    if args.prefill and not health.get("mock"):
        prefill_ratio(args.url, args.peer_url, model, health, args.prefill, max(3, args.repeat), gguf)
    if args.fill_context and not health.get("mock"):
        rows, length = health["rows_total"], health["context_length"]
        text = long_prompt(health["model_dir"], length - 40)  # with 8 new tokens, each row ends near its length
        # the prompt once first: the prefix cache then holds it and every row copies it instead of computing it
        # (32 rows of a 1.5B model's 2,000 tokens would take about 8 minutes of prefill on 2 cores)
        run_load(args.url, model, 1, 1, count, api="openai", texts=[text])
        print_row("every row's context", run_load(args.url, model, rows, 8, count, api="openai", texts=[text] * rows))
        print(f"engine memory, every row's context filled: {process_memory(health.get('backend_pid'))}")
        print_server_memory(health, args.peer_pid, "every row's context filled")
    if offline:
        offline.llm.close()


def prefill_ratio(
    url: str, peer_url: str | None, model: str, health: dict, length: int, repeat: int, gguf: Path | None = None
) -> None:
    """--prefill: a prompt of ``length`` tokens, fresh each time (a tag never sent before in front, so no prompt
    cache holds it), answered with one token through /v1/completions on the server and the peer, interleaved.
    With the served GGUF known, each side's multiply-adds a second in the linears against the int8 compute
    probe (``compute_probe``): how near each comes to the ceiling of this CPU level."""
    text = long_prompt(health["model_dir"], length)
    sides = [("server", url)] + ([("peer", peer_url)] if peer_url else [])
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(repeat):
        for label, u in sides:
            body = {"model": model, "prompt": f"Run {i} {time.time_ns()}. {text}", "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            requests.post(f"{u}/v1/completions", json=body, timeout=900).raise_for_status()
            times[label].append(time.perf_counter() - start)
    medians = {label: statistics.median(t) for label, t in times.items()}
    for label, m in medians.items():
        runs = len(times[label])
        print(f"prefill {length} tokens  {label:6s} median {m:.2f} s = {length / m:.0f} tok/s ({runs} runs)")
    weights = linear_weights(gguf) if gguf is not None else None
    peak = compute_probe(health) if weights else None
    if weights and peak:
        for label, m in medians.items():
            rate = length * weights / m
            share = 100 * rate / peak
            print(f"  {label:6s} {rate / 1e9:.1f} G multiply-adds/s in the linears, {share:.0f} % of the probe")
    if peer_url:
        print(f"ratio: prefill server / peer = {medians['peer'] / medians['server']:.2f}x faster")


# --structured: every stream writes a JSON object holding one long string, long enough that no stream ends before
# --max-tokens (as the unconstrained ones, with --ignore-eos): the same tokens on both sides of the ratio
STORY_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "story",
        "schema": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 4000}},
            "required": ["story"],
            "additionalProperties": False,
        },
    },
}


def large_schema(fields: int, tag: int) -> dict:
    """A schema of many fields, unique per call (no compiled-grammar cache holds it)."""
    props = {
        f"field_{tag}_{i}": (
            {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 9}}}$"}
            if i % 3 == 0
            else {"type": "integer", "minimum": -i, "maximum": i * 10}
            if i % 3 == 1
            else {"enum": [f"v{i}_{j}" for j in range(5)]}
        )
        for i in range(fields)
    }
    return {"type": "object", "properties": props, "required": list(props)[: fields // 2]}


def compile_stall(url: str, model: str, concurrency: int, max_tokens: int, count) -> None:
    """The other streams' inter-token gaps while requests with large new schemas arrive, against the same load
    without them: a schema compiled on the decode loop would show as one long gap."""
    results = {}
    for label, inject in (("alone", False), ("with schemas", True)):

        def injector():
            time.sleep(0.5)
            for tag in range(4):
                fmt = {
                    "type": "json_schema",
                    "json_schema": {"name": "big", "schema": large_schema(300, time.time_ns() + tag)},
                }
                openai_stream(url, model, "Fill in the form.", 8, {}, Stream(), extra={"response_format": fmt})

        t = threading.Thread(target=injector) if inject else None
        if t:
            t.start()
        r = run_load(
            url,
            model,
            concurrency - 1,
            max_tokens,
            count,
            api="openai",
            texts=prompts(concurrency - 1),
            extra={"ignore_eos": True},
        )
        if t:
            t.join(120)
        results[label] = r
        print(
            f"{'other streams, ' + label:<34} c={concurrency - 1:<3} ITL p50 {r['itl_p50'] * 1e3:6.1f} ms "
            f"p99 {r['itl_p99'] * 1e3:6.1f} ms  max {r['itl_max'] * 1e3:6.1f} ms"
        )
    print(
        f"compile stall: the others' longest gap {results['with schemas']['itl_max'] * 1e3:.1f} ms with 4 new "
        f"300-field schemas arriving, {results['alone']['itl_max'] * 1e3:.1f} ms without"
    )


def flood_ttft(url: str, model: str, health: dict, streams: int = 8, probes: int = 5) -> None:
    """A short request's time to its first token, sent ``probes`` times one after another by team "victim": alone,
    then while ``streams`` loops of team "flood" send long prompts (each new: no prefix cache holds it) with one
    token to generate, as fast as they are answered."""
    length = min(1000, health["context_length"] // 2)
    text = long_prompt(health["model_dir"], length) if not health.get("mock") else "word " * length

    def probe_ttft() -> list[float]:
        times = []
        for _ in range(probes):
            s = Stream()
            openai_stream(url, model, "Name a color.", 2, {"X-Team-Id": "victim"}, s)
            if s.arrivals:
                times.append(s.arrivals[0] - s.start)
        return times

    alone = probe_ttft()
    stop = threading.Event()
    sent = itertools.count()

    def flood() -> None:
        while not stop.is_set():
            s = Stream()
            openai_stream(url, model, f"{next(sent)} {text}", 1, {"X-Team-Id": "flood"}, s)

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the flood's first prompts are in the rows
    flooded = probe_ttft()
    stop.set()
    for t in threads:
        t.join(300)

    def summary(times: list[float]) -> str:
        return (
            f"p50 {pct(times, 0.5) * 1e3:.0f} ms, p90 {pct(times, 0.9) * 1e3:.0f} ms, "
            f"max {max(times, default=float('nan')) * 1e3:.0f} ms ({len(times)} of {probes} answered)"
        )

    print(f"short request's TTFT alone: {summary(alone)}")
    print(
        f"short request's TTFT beside {streams} streams of {length}-token prompts from another team: "
        f"{summary(flooded)}; {next(sent) - streams} flood prompts answered meanwhile"
    )


CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "avx512_vp2intersect",
    "amx_tile",
)

# AMD's cores by family and model (a virtual machine's model name is often just "AMD EPYC"): (family, first model,
# last model, name), from AMD's published family and model numbers
AMD_CORES = (
    (23, 0x00, 0x2F, "Zen / Zen+"),
    (23, 0x30, 0xFF, "Zen 2"),
    (25, 0x00, 0x0F, "Zen 3"),
    (25, 0x10, 0x1F, "Zen 4"),
    (25, 0x20, 0x5F, "Zen 3"),
    (25, 0x60, 0xAF, "Zen 4"),
    (26, 0x00, 0xFF, "Zen 5"),
)


def cpu_core(info: str) -> str:
    """The CPU's family and model numbers from /proc/cpuinfo's text, with AMD's core name where the table knows
    it: "family 25 model 17 (Zen 4)"; "" where the file says nothing of them."""
    field = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        field.setdefault(key.strip(), value.strip())
    try:
        family, model = int(field["cpu family"]), int(field["model"])
    except (KeyError, ValueError):
        return ""
    name = ""
    if field.get("vendor_id") == "AuthenticAMD":
        name = next((n for f, lo, hi, n in AMD_CORES if f == family and lo <= model <= hi), "")
    return f"family {family} model {model}" + (f" ({name})" if name else "")


def cpu_line(health: dict) -> str:
    """This CPU's model (its family and model numbers too) and the instruction-set flags the kernels care about
    (avx_vnni and avx512_vp2intersect tell a Zen 5 from a Zen 4), and the kernel path the server runs (its
    /health's ``kernels``: "native", "prebuilt avx2", "level avx2", ...)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    core = cpu_core(info)
    flags = set(next((line for line in info.splitlines() if line.startswith("flags")), "").split())
    have = " ".join(f for f in CPU_FLAGS if f in flags)
    return (
        f"CPU: {name}{', ' + core if core else ''}; flags: {have or 'none of ' + ' '.join(CPU_FLAGS)}; "
        f"server kernels: {health.get('kernels')}"
    )


def process_memory(pid: int | None) -> str | None:
    """A process's resident memory now and at its peak (servers run on this host: loopback)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (TypeError, OSError):
        return None
    kib = dict(re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", status, re.M))
    return f"{int(kib['VmRSS']) / 2**20:.2f} GiB resident, peak {int(kib['VmHWM']) / 2**20:.2f} GiB"


def server_processes(engine_pid: int) -> list[int]:
    """Every process of the server whose engine this is: the topmost of its ancestors that runs this server
    (gunicorn's first process), and everything below it (the web worker, the engine, multiprocessing's tracker)."""

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def ours(pid: int) -> bool:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"inference_api" in cmdline or b"inference-api" in cmdline

    top = engine_pid
    while parent(top) > 1 and ours(parent(top)):
        top = parent(top)
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(parent(int(entry.name)), []).append(int(entry.name))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    found, todo = [], [top]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def proportional_memory(pids: list[int]) -> float:
    """GiB the processes hold together: each one's proportional set size (a page shared by n processes counts 1/n
    in each), so pages a fork shares count once."""
    total = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.M).group(1))  # type: ignore[union-attr]
    return total / 2**20


def print_server_memory(health: dict, peer_pid: int | None, when: str = "") -> None:
    """The whole server's memory (every process of it: the web worker and gunicorn's first process beside the
    engine) and the peer's, proportional set sizes; nothing where the server does not run on this host."""
    try:
        pids = server_processes(int(health["backend_pid"]))
    except (KeyError, TypeError, ValueError, OSError):
        return
    peer = f", peer {proportional_memory([peer_pid]):.2f} GiB" if peer_pid else ""
    label = f"server memory, {when}" if when else "server memory"
    print(f"{label} (all {len(pids)} processes, proportional): {proportional_memory(pids):.2f} GiB{peer}")


def median_row(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs of one load."""
    row = {k: (statistics.median(r[k] for r in runs) if isinstance(v, float) else v) for k, v in runs[-1].items()}
    return {**row, "errors": sum(r["errors"] for r in runs)}


def proxy_headers(secret: str | None) -> dict[str, str]:
    import jwt

    token = jwt.encode(
        {"team_id": "bench", "token_id": "bench", "exp": int(time.time()) + 86400},
        secret or os.environ["JWT_SECRET"],
        algorithm="HS256",
    )
    return {"Authorization": f"Bearer {token}"}


if __name__ == "__main__":
    main()
