#!/usr/bin/env python3
"""A decode step of many rows with LoRA adapters against the same step on the base model alone (issue 43's speed).

    .venv/bin/python scripts/bench_lora.py [--rows 32] [--adapters 4] [--rank 8] [--steps 20] [--model PATH]

The model (default: the embedded SmolLM2) is loaded as the server loads it; ADAPTERS random rank-RANK adapters on
every linear (q, k, v, o, gate, up, down) are put in its slots, the rows prefilled, then decode steps are timed in
turns: every row on the base (the fused decoder), and the rows spread over the adapters in turn (the layer loop and
the adapters' low-rank terms). Prints the median step of each and their ratio (tokens per second, adapters over
base); a profile of the adapter step with --profile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def random_adapter(name: str, runner, rank: int, seed: int):
    """A LoraAdapter of random A and B on every tensor the model's linears have."""
    import torch

    from inference_api.model.lora import LoraAdapter, LoraWeight, targets

    gen = torch.Generator().manual_seed(seed)
    adapter = LoraAdapter(name, "<random>", float(2 * rank))
    for tensor, t in targets(runner.config, runner.model.spec.family).items():
        a = torch.randn(rank, t.cols, generator=gen) * 0.02
        b = torch.randn(t.rows, rank, generator=gen) * 0.02
        adapter.weights[tensor] = LoraWeight(a, b, 2.0)
    return adapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-cache-dir", default="model_cache")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--torch-terms", action="store_true", help="the adapters' terms by torch's matmuls")
    args = ap.parse_args()
    import torch

    from inference_api.config import ServerConfig
    from inference_api.engine.model_runner import ModelRunner
    from inference_api.engine.process import build_engine
    from inference_api.model.lora import LoraSlots, targets

    flags = ["--rows", str(args.rows), "--context-length", "512", "--model-cache-dir", args.model_cache_dir]
    engine, ready = build_engine(ServerConfig.from_args([*flags, *(["--model", args.model] if args.model else [])], {}))
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    model = runner.model
    model.lora = LoraSlots(
        targets(runner.config, model.spec.family),
        runner.config.num_hidden_layers,
        runner.device,
        runner.dtype,
        None if args.torch_terms else model.kernels,
    )
    slots = [model.lora.add(random_adapter(f"a{i}", runner, args.rank, i)) for i in range(args.adapters)]
    rows = list(range(args.rows))
    prompt = list(range(10, 42))
    runner.prefill(rows, [prompt] * len(rows), [0] * len(rows))
    positions = [len(prompt)] * len(rows)
    tokens = [7] * len(rows)

    fused = model.fused

    def step(mode: str) -> float:
        """base: every row on the base (the fused decoder where the model has one); loop: the same through the
        layer loop; lora: the rows spread over the adapters."""
        for r in rows:
            runner.use_adapters(r, ((slots[r % len(slots)], 1.0),) if mode == "lora" else ())
        model.fused = None if mode == "loop" else fused
        start = time.perf_counter()
        runner.decode(rows, tokens, positions)  # (the same position each time: written over)
        took = time.perf_counter() - start
        model.fused = fused
        return took

    modes = ("base", "loop", "lora")
    for _ in range(3):
        for mode in modes:
            step(mode)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.steps):
        for mode in modes:
            times[mode].append(step(mode))
    base, loop, lora = (statistics.median(times[m]) for m in modes)
    print(
        f"model {ready.model_name}, {ready.device} {ready.dtype}, weights {ready.quantize}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"decode step of {args.rows} rows: base {base * 1e3:.1f} ms (the layer loop: {loop * 1e3:.1f} ms), over "
        f"{args.adapters} rank-{args.rank} adapters {lora * 1e3:.1f} ms"
    )
    print(f"tokens/s ratio (adapters / base): {base / lora:.2f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step("lora")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
