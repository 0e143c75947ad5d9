#!/usr/bin/env python3
"""What one all-reduce of a decode step's hidden state costs between tensor-parallel ranks on this machine.

Starts --ranks processes joined in the engine's own gloo group (inference_api/engine/parallel.py: a TCP store on
a free loopback port), times --calls all-reduces of a float32 [rows, hidden] tensor for each row count after a
warm-up, and prints rank 0's mean and median per call. A decode step of the compact model makes two per layer
(after attention's o and after the MLP's down). Bounded: every rank does exactly the same number of calls.

    python scripts/bench_allreduce.py --ranks 3 --hidden 576 --rows 1 32 --calls 1000
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, size: int, port: int, hidden: int, rows: list[int], calls: int, threads: int, out) -> None:
    import torch

    from inference_api.engine.parallel import Group

    torch.set_num_threads(threads)
    group = Group(rank, size, Group.store(size, port))
    results = {}
    for n in rows:
        t = torch.randn(n, hidden)
        for _ in range(50):  # warm-up
            group.all_reduce(t)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            group.all_reduce(t)
            times.append(time.perf_counter() - start)
        results[n] = times
    group.close()
    if out is not None:
        out.send(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    from inference_api.engine.parallel import Group

    ctx = multiprocessing.get_context("spawn")
    store = Group.store(args.ranks)
    others = [
        ctx.Process(
            target=_rank,
            args=(r, args.ranks, store.port, args.hidden, args.rows, args.calls, args.threads, None),
            daemon=True,
        )
        for r in range(1, args.ranks)
    ]
    for p in others:
        p.start()
    ours, theirs = ctx.Pipe()
    _rank(0, args.ranks, store.port, args.hidden, args.rows, args.calls, args.threads, theirs)
    for p in others:
        p.join(60)
    for n, times in ours.recv().items():
        kib = n * args.hidden * 4 / 1024
        print(
            f"{args.ranks} ranks, [{n}, {args.hidden}] float32 ({kib:.1f} KiB): "
            f"mean {statistics.mean(times) * 1e6:.0f} us, "
            f"median {statistics.median(times) * 1e6:.0f} us, p99 {sorted(times)[int(len(times) * 0.99)] * 1e6:.0f} us "
            f"per all-reduce ({args.calls} calls)"
        )


if __name__ == "__main__":
    main()
