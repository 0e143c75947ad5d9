#!/usr/bin/env python3
"""Where a CUDA decode step's time goes: for a few batch sizes, the GPU time of one replay of the captured graph,
the same static step run eagerly, and how many kernels one step launches (torch's profiler over the eager step).
Against the engine's decode step time (scripts/bench.py prints it) this separates the GPU's share from the
host's. Default model and plan on CUDA; bounded: a few hundred steps, no server.

    python scripts/profile_decode.py [--rows 32] [--context 2048]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def gpu_ms(fn, repeat: int) -> float:
    """The median GPU time of fn in milliseconds (CUDA events around each call, after a warm-up)."""
    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference_api.config import ServerConfig
    from inference_api.engine.cuda_graphs import DecodeGraphs
    from inference_api.engine.model_runner import ModelRunner
    from inference_api.engine.plan import make_plan, model_facts, probe_machine
    from inference_api.model.gguf_model import GGUFModel
    from inference_api.model.loader import embedded_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()

    gguf = embedded_gguf()
    plan = make_plan(ServerConfig(device="cuda"), model_facts(gguf, None), probe_machine("cuda"))
    runner = ModelRunner(GGUFModel(gguf, "cuda", plan.torch(plan.dtype)), args.rows, args.context, plan)
    graphs = runner.graphs
    if graphs is None:
        sys.exit("the capture failed (see the warning above)")
    eager = DecodeGraphs(runner.model, runner.cache, args.rows, runner.device, capture=False)
    print(f"{torch.cuda.get_device_name()}, {plan.describe()}, {args.rows} rows x {args.context} positions")
    print("rows  span  graph replay  eager static step  kernels a step")
    for size in [n for n in (1, 8, 32) if n in graphs.captured]:
        for span in sorted({graphs.spans[0], graphs.spans[-1]}):
            replay = gpu_ms(graphs.graphs[size, span].replay, 200)
            step = gpu_ms(lambda: runner.model.forward(eager._batch(size, span), runner.cache), 50)  # noqa: B023
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model.forward(eager._batch(size, span), runner.cache)
                torch.cuda.synchronize()
            kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
            print(f"{size:4d}  {span:4d}  {replay:9.3f} ms  {step:14.3f} ms  {kernels:14d}")


if __name__ == "__main__":
    main()
