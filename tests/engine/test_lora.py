"""LoRA adapters per row: read from llama.cpp's GGUF and PEFT's folder alike, checked against llama-server's greedy
answers on the same base file and adapters, mixed in one step without changing another row's numbers, kept apart
in the prefix cache, loaded and unloaded at run time, and through the offline API (tests/data/lora/, made by
scripts/make_lora_data.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from servers import MODEL_CACHE, wait_for
from test_speculative import FixedCosts, run, tokens

from inference_api.config import ServerConfig
from inference_api.engine.engine import Engine
from inference_api.engine.messages import (
    FinishReason,
    GenerateRequest,
    LoadAdapter,
    SamplingParams,
    UnloadAdapter,
)
from inference_api.engine.process import build_engine
from inference_api.model.lora import load_adapter
from inference_api.model.lora_files import adapter_specs

DATA = Path(__file__).resolve().parent.parent / "data" / "lora"
BASE = DATA / "base-q8_0.gguf"
NAMES = ("all7", "qv", "mlp")
REFERENCE = json.loads((DATA / "llamacpp.json").read_text())
AGREE = 10  # of 12 prompts, the greedy first token as llama-server's (issue 43's bar)


def flags(*extra: str, rows: int = 8) -> list[str]:
    return [
        "--model",
        str(BASE),
        "--rows",
        str(rows),
        "--context-length",
        "256",
        "--model-cache-dir",
        MODEL_CACHE,
        *extra,
    ]


def lora_flags(fmt: str) -> list[str]:
    return [a for n in NAMES for a in ("--lora", f"{n}={DATA / n}{'.gguf' if fmt == 'gguf' else ''}")]


_engines: dict[tuple, Engine] = {}


def engine(*extra: str, rows: int = 8) -> Engine:
    """An engine over the tiny base (built once per flags in this module; every test leaves it idle)."""
    key = (*extra, rows)
    if key not in _engines:
        _engines[key] = build_engine(ServerConfig.from_args(flags(*extra, rows=rows), {}))[0]
    return _engines[key]


def ask(sid: str, ids, lora=(), max_tokens: int = 8, **params) -> GenerateRequest:
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=tuple(lora), **params)
    return GenerateRequest(sid, tuple(ids), sampling)


def test_a_gguf_adapter_and_its_peft_folder_hold_the_same_weights():
    """llama.cpp's converter permutes B's q and k rows with the weights': read back, they are PEFT's, and the scales
    (alpha / rank, a rank_pattern's own rank) agree."""
    runner = engine().runner
    for name in NAMES:
        args = (runner.config, runner.model.spec.family, runner.gguf_arch)
        gguf, peft = load_adapter(name, DATA / f"{name}.gguf", *args), load_adapter(name, DATA / name, *args)
        assert sorted(gguf.weights) == sorted(peft.weights) and gguf.weights
        for tensor, w in gguf.weights.items():
            p = peft.weights[tensor]
            assert torch.equal(w.a, p.a) and torch.equal(w.b, p.b), tensor
            assert w.scale == pytest.approx(p.scale), tensor
    mlp = load_adapter("mlp", DATA / "mlp", *args)
    assert mlp.weights["blk.0.ffn_down"].scale == 4 / 2 and mlp.weights["blk.0.ffn_up"].scale == 4 / 4


@pytest.mark.parametrize("fmt", ["gguf", "peft"])
def test_greedy_answers_agree_with_llama_server(fmt):
    """Each case of llamacpp.json (the base, each adapter, a scale of 0.5, two adapters with scales) in one batch
    of 12 rows: the first greedy token as llama-server's on at least 10 of 12 prompts."""
    eng = engine(*lora_flags(fmt), rows=12)
    for case in REFERENCE["cases"]:
        lora = [(n, s) for n, s in case["lora"]]
        out = run(eng, [ask(f"p{i}", ids, lora) for i, ids in enumerate(REFERENCE["prompt_ids"])])
        ours = [tokens(out[f"p{i}"]) for i in range(len(REFERENCE["prompts"]))]
        agree = sum(o[:1] == r[:1] for o, r in zip(ours, case["tokens"]))
        assert agree >= AGREE, (fmt, lora, agree)


def test_rows_with_different_adapters_and_without_share_a_step():
    """Base rows, rows of different adapters and a row of two decode together: each row's tokens are its tokens
    alone, and the base rows' logits are bit for bit those of a step with no adapter row (the fused decoder)."""
    eng = engine(*lora_flags("gguf"))
    prompts = REFERENCE["prompt_ids"]
    loras = [(), [("all7", 1.0)], (), [("qv", 1.0), ("mlp", 0.7)], [("all7", 0.5)], ()]
    together = run(eng, [ask(f"r{i}", prompts[i], lora, 12) for i, lora in enumerate(loras)])
    for i, lora in enumerate(loras):
        alone = run(eng, [ask("alone", prompts[i], lora, 12)])
        assert tokens(together[f"r{i}"]) == tokens(alone["alone"]), (i, lora)
    # the runner: a decode step of rows 0..3 (1 and 3 with adapters) against the base rows' step alone
    runner, adapters = eng.runner, eng.adapters
    slots = {n: adapters.loaded[n].slot for n in NAMES}
    rows = [0, 1, 2, 3]
    for row in rows:
        runner.use_adapters(row, ())
    runner.prefill(rows, [prompts[r] for r in rows], [0] * 4)
    positions = [len(prompts[r]) for r in rows]
    runner.use_adapters(1, ((slots["all7"], 1.0),))
    runner.use_adapters(3, ((slots["qv"], 1.0), (slots["mlp"], 0.7)))
    mixed = runner.decode(rows, [5, 6, 7, 8], positions)
    assert runner.model.fused is not None  # the kernels' Decoder took that step, adding the terms...
    fused_rows, runner.model.fused_max_rows = runner.model.fused_max_rows, 0
    try:  # ...as the layer loop adds them, bit for bit
        assert torch.equal(runner.decode(rows, [5, 6, 7, 8], positions), mixed)
    finally:
        runner.model.fused_max_rows = fused_rows
    base = runner.decode([0, 2], [5, 7], [positions[0], positions[2]])
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[1])
    one = runner.decode([1], [6], [positions[1]])
    assert torch.allclose(mixed[1], one[0], atol=1e-4) and not torch.allclose(mixed[1], mixed[0])
    # a prefill chunk shared with adapter rows gives a base row the logits of its chunk alone, bit for bit
    shared = runner.prefill(rows, [prompts[r] for r in rows], [0] * 4)
    runner.use_adapters(1, ())
    runner.use_adapters(3, ())
    assert torch.equal(shared[0], runner.prefill([0], [prompts[0]], [0])[0])
    for row in rows:
        runner.use_adapters(row, ())


def test_speculation_checks_an_adapter_rows_drafts_with_its_adapter():
    """Prompt lookup drafts for an adapter row are checked by a forward that applies the adapter: the tokens are
    those of speculation off."""
    first = REFERENCE["prompt_ids"][0]
    answer = tokens(run(engine(*lora_flags("gguf"), rows=2), [ask("s", first, [("all7", 1.0)], 24)])["s"])
    prompt = first + answer + first  # prompt lookup drafts the answer again
    out = []
    for extra in ([], ["--spec-type", "off"]):
        eng = engine(*lora_flags("gguf"), *extra, rows=2)
        eng.costs = FixedCosts(per_token=0.0001)  # every draft pays
        out.append(tokens(run(eng, [ask("s", prompt, [("all7", 1.0)], 24)])["s"]))
        assert (eng.spec is None) == bool(extra) and (eng.stats.spec_drafted_tokens > 0) != bool(extra)
    assert out[0] == out[1]


def test_the_prefix_cache_never_shares_a_row_across_adapter_sets():
    eng = engine(*lora_flags("gguf"), rows=2)
    prompt = REFERENCE["prompt_ids"][1] * 3
    cached = {}
    for sid, lora in [
        ("a", [("all7", 1.0)]),
        ("b", [("all7", 1.0)]),
        ("base", []),
        ("half", [("all7", 0.5)]),
        ("two", [("all7", 1.0), ("qv", 1.0)]),
    ]:
        events = run(eng, [ask(sid, prompt, lora, 2)])[sid]
        cached[sid] = events[-1].cached_tokens
    assert cached["base"] == cached["half"] == cached["two"] == 0
    assert cached["b"] > 0  # the same adapter and scale: its prefix is reused


def test_an_unknown_adapter_is_an_error_event_and_runtime_unload_lets_rows_finish():
    eng = engine(rows=2)  # no --lora
    assert not eng.adapters.infos
    [event] = run(eng, [ask("x", [0, 5, 6], [("nope", 1.0)])])["x"]
    assert event.finish_reason is FinishReason.ERROR and "'nope' is not loaded" in event.error
    reply = eng.adapter_message(LoadAdapter("1", "qv", str(DATA / "qv.gguf")))
    assert reply.error is None and reply.info.rank == 4 and [a.name for a in reply.adapters] == ["qv"]
    eng.add(ask("running", [0, 5, 6], [("qv", 1.0)], 6))
    eng.step()
    slot = eng.adapters.loaded["qv"].slot
    reply = eng.adapter_message(UnloadAdapter("2", "qv"))
    assert reply.unloaded and reply.adapters == ()
    out = run(eng, [ask("late", [0, 5], [("qv", 1.0)])])
    assert out["late"][0].error is not None and "qv" in out["late"][0].error
    assert out["running"][-1].finish_reason is FinishReason.LENGTH and out["running"][-1].completion_tokens == 6
    assert "qv" not in eng.adapters.loaded and slot not in eng.runner.model.lora.adapters  # freed after the last
    reply = eng.adapter_message(LoadAdapter("3", "bad", str(DATA / "llamacpp.json")))
    assert reply.error is not None and "unknown format" in reply.error and "llamacpp.json" in reply.error


def test_adapters_that_do_not_fit_are_refused_with_the_reason(tmp_path):
    runner = engine().runner
    args = (runner.config, runner.model.spec.family, runner.gguf_arch)
    with pytest.raises(ValueError, match="architecture 'llama', the model is 'qwen2'"):
        load_adapter("x", DATA / "qv.gguf", runner.config, runner.model.spec.family, "qwen2")
    folder = tmp_path / "wide"
    shutil.copytree(DATA / "qv", folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        load_adapter("x", folder, *args)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(DATA / "qv" / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    for change, why in [
        (lambda t: {k: torch.cat([v, v], -1) if "lora_A" in k else v for k, v in t.items()}, "in the model"),
        (lambda t: {k.replace("q_proj", "qkv_proj"): v for k, v in t.items()}, "no tensor of a llama model"),
        (lambda t: {**t, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, "output head"),
    ]:
        save_file(change(dict(tensors)), str(folder / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=why) as err:
            load_adapter("x", folder, *args)
        assert str(folder) in str(err.value)
    assert adapter_specs(["a=x.gguf", "dir/b", "c.gguf"]) == [("a", "x.gguf"), ("b", "dir/b"), ("c", "c.gguf")]
    with pytest.raises(ValueError, match="given twice"):
        adapter_specs(["a=x", "a=y"])


def test_load_and_unload_through_the_engine_process():
    from inference_api.engine.client import EngineClient

    client = EngineClient(ServerConfig.from_args(flags(*lora_flags("peft")[:2], rows=2), {})).start()
    try:
        wait_for(lambda: client.ready is not None or client.failure is not None, timeout=120)
        assert client.failure is None, client.failure
        assert [a.name for a in client.adapters] == ["all7"] and client.ready.adapters[0].rank == 8
        info = client.load_adapter("qv", str(DATA / "qv.gguf"))
        assert (info.name, info.rank, info.alpha) == ("qv", 4, 8.0) and info.bytes > 0
        assert [a.name for a in client.adapters] == ["all7", "qv"]
        with pytest.raises(ValueError, match="unknown format"):
            client.load_adapter("bad", str(DATA / "llamacpp.json"))
        case = next(c for c in REFERENCE["cases"] if c["lora"] == [["qv", 1.0]])
        session = client.submit(REFERENCE["prompt_ids"][0], ask("", [], [("qv", 1.0)]).params)
        got = []
        while not session.done or not session.events.empty():
            event = session.events.get(timeout=60)
            assert event.error is None, event.error
            got += event.token_ids
        assert got[:1] == case["tokens"][0][:1]
        session = client.submit([0, 5], ask("", [], [("gone", 1.0)]).params)
        event = session.events.get(timeout=60)
        assert event.finish_reason is FinishReason.ERROR and "'gone' is not loaded" in event.error
        assert client.unload_adapter("qv") and not client.unload_adapter("qv")
        assert [a.name for a in client.adapters] == ["all7"]
        assert client.process is not None and client.process.is_alive()
    finally:
        client.shutdown()


def test_the_offline_api_with_an_adapter():
    from inference_api import LLM
    from inference_api import SamplingParams as Params

    case = next(c for c in REFERENCE["cases"] if c["lora"] == [["all7", 0.5]])
    with LLM(
        str(BASE), lora={"all7": str(DATA / "all7.gguf")}, rows=2, context_length=256, model_cache_dir=MODEL_CACHE
    ) as llm:
        assert [a.name for a in llm.adapters] == ["all7"]
        ids = REFERENCE["prompt_ids"][:3]
        params = Params(temperature=0, max_tokens=8, ignore_eos=True, lora={"all7": 0.5})
        outs = llm.generate(ids, params, use_tqdm=False)
        agree = sum(list(o.token_ids[:1]) == r[:1] for o, r in zip(outs, case["tokens"]))
        assert agree >= 2
        base = llm.generate(ids[:1], Params(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert base[0].token_ids != outs[0].token_ids
        assert llm.unload_adapter("all7") and llm.adapters == ()


def test_the_flag_pre_flight_and_the_mock():
    """--lora repeated (the environment's LORA separated by commas), its adapters' numbers counted by pre-flight in the
    model's dtype, and the mock refusing adapters at start."""
    from inference_api.engine.preflight import estimate
    from inference_api.model.lora_files import adapter_params

    config = ServerConfig.from_args(flags(*lora_flags("gguf")), {})
    assert config.lora == tuple(f"{n}={DATA / n}.gguf" for n in NAMES)
    assert ServerConfig.from_args([], {"LORA": "a=x.gguf, b"}).lora == ("a=x.gguf", "b")
    assert ServerConfig.from_args(["--lora", "c"], {"LORA": "a=x.gguf"}).lora == ("c",)
    numbers = sum(adapter_params(DATA / f"{n}.gguf") for n in NAMES)
    assert numbers == sum(adapter_params(DATA / n) for n in NAMES) > 0
    with_lora, without = estimate(config), estimate(ServerConfig.from_args(flags(), {}))
    assert with_lora.weights_bytes - without.weights_bytes == numbers * 2  # float16 where the CPU kernels add terms
    with pytest.raises(RuntimeError, match="mock engine takes no LoRA"):
        build_engine(ServerConfig(mock=True, lora=("a=x.gguf",)))


@pytest.mark.parametrize("rank", [8, 7])  # (7: a tail of the four-row passes)
def test_the_kernels_lora_terms_equal_the_matmuls_at_each_level(kernels, rank):
    """lora_add (each (token, adapter, scale) pair's term, by adapter) against torch's matmuls, at this CPU's level
    and the AVX2 one, with a token of two adapters, a token of none and widths past the vectors'."""
    gen = torch.Generator().manual_seed(rank)
    tokens, k, n, slots = 6, 70, 45, 3
    x, y = torch.randn(tokens, k, generator=gen), torch.randn(tokens, n, generator=gen)
    a = torch.randn(slots, rank, k, generator=gen).half()  # (the kernels hold adapters in float16)
    b = torch.randn(slots, rank, n, generator=gen).half()
    pairs = [(0, 0, 1.0), (1, 2, 0.5), (3, 0, -2.0), (3, 1, 1.0), (5, 2, 1.5)]  # token 2 and 4: none; 3: two
    pairs.sort(key=lambda p: (p[1], p[0]))
    out = y.clone()
    kernels.lora_add(
        x,
        a,
        b,
        torch.tensor([t for t, _, _ in pairs]),
        torch.tensor([s for _, s, _ in pairs]),
        torch.tensor([c for _, _, c in pairs], dtype=torch.float32),
        out,
    )
    expected = y.clone()
    for t, s, c in pairs:
        expected[t] += c * (a[s].float() @ x[t]) @ b[s].float()
    assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[2], y[2]) and torch.equal(out[4], y[4])
    wide = torch.zeros(tokens, n + 9)  # y as a slice of wider rows (a tensor's columns in its linear)
    wide[:, 5 : 5 + n] = y
    cols = wide[:, 5 : 5 + n]
    kernels.lora_add(x, a, b, torch.tensor([4]), torch.tensor([1]), torch.tensor([0.5]), cols)
    assert wide[:, :5].eq(0).all() and wide[:, 5 + n :].eq(0).all() and torch.equal(cols[:4], y[:4])
    assert torch.allclose(cols[4], y[4] + 0.5 * (a[1].float() @ x[4]) @ b[1].float(), atol=1e-4, rtol=1e-4)


def test_the_grouped_matmuls_add_the_terms_the_kernels_add(kernels):
    """LoraSlots' two forms (the kernels' pairs on CPU; the grouped batched matmuls, CUDA's) add the same terms: two
    adapters on a fused qkv (q and v parts) and a whole linear, tokens of one adapter, of two, and of none."""
    from inference_api.model.lora import LoraAdapter, LoraGroups, LoraPairs, LoraSlots, LoraWeight, Target

    gen = torch.Generator().manual_seed(3)
    targets = {
        "blk.0.attn_q": Target("qkv", 0, 8, 16),
        "blk.0.attn_v": Target("qkv", 12, 4, 16),
        "blk.0.ffn_down": Target("down", 0, 16, 24),
    }
    forms = [LoraSlots(targets, 1, "cpu", torch.float32, kernels), LoraSlots(targets, 1, "cpu", torch.float32)]
    for i, rank in enumerate((4, 3)):
        adapter = LoraAdapter(f"a{i}", "<random>", 1.0)
        for name, t in targets.items():
            if name != "blk.0.attn_v" or i == 0:
                a, b = torch.randn(rank, t.cols, generator=gen), torch.randn(t.rows, rank, generator=gen)
                a, b = a.half().float(), b.half().float()  # (numbers the kernels' float16 holds as they are)
                adapter.weights[name] = LoraWeight(a, b, 0.5)
        assert [form.add(adapter) for form in forms] == [i, i]
    pairs = [(0, 0, 1.0), (1, 1, 0.5), (2, 0, 1.0), (2, 1, -1.0), (4, 1, 2.0)]  # token 3: no adapter
    for role, fan_in, fan_out in (("qkv", 16, 16), ("down", 24, 16)):
        x, y = torch.randn(5, fan_in, generator=gen), torch.randn(5, fan_out, generator=gen)
        outs = []
        for form in forms:
            plan = form.plan(pairs, 5)
            assert plan is not None and isinstance(plan, LoraPairs) == (form.kernels is not None)
            outs.append(form.add_delta(0, role, x, y.clone(), plan))
        assert torch.allclose(outs[0], outs[1], atol=1e-5) and torch.equal(outs[0][3], y[3])
        every = [(t, 1, 1.0) for t in range(5)]  # one adapter on every token: the matmuls straight onto y
        whole, paired = forms[1].plan(every, 5), forms[0].plan(every, 5)
        assert isinstance(whole, LoraGroups) and whole.whole and paired is not None
        kernel_terms = forms[0].add_delta(0, role, x, y.clone(), paired)
        assert torch.allclose(forms[1].add_delta(0, role, x, y.clone(), whole), kernel_terms, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_adapter_rows_replay_their_own_graphs_and_answer_as_llama_server():
    """The tiny LoRA base on CUDA with graphs: each llamacpp.json case (the base, each adapter, a scale, two
    adapters in a row) in one batch of 12 rows agrees with llama-server's first greedy token on at least 10 of
    12 prompts; steps of one adapter a row replay graphs captured for them, which give the logits of the same
    static step run eagerly."""
    from inference_api.engine.cuda_graphs import DecodeGraphs
    from inference_api.engine.model_runner import ModelRunner

    eng = build_engine(ServerConfig.from_args([*flags(*lora_flags("gguf"), rows=12), "--device", "cuda"], {}))[0]
    runner = eng.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    for case in REFERENCE["cases"]:
        lora = [(n, s) for n, s in case["lora"]]
        out = run(eng, [ask(f"p{i}", ids, lora) for i, ids in enumerate(REFERENCE["prompt_ids"])])
        ours = [tokens(out[f"p{i}"]) for i in range(len(REFERENCE["prompts"]))]
        agree = sum(o[:1] == r[:1] for o, r in zip(ours, case["tokens"]))
        print(f"{lora}: {agree} of 12 first tokens as llama-server's")
        assert agree >= AGREE, (lora, agree)
    assert runner.graphs.lora_graphs  # the adapter steps' own graphs were captured and replayed
    slots = {name: eng.adapters.loaded[name].slot for name in ("all7", "qv")}
    rows, ids = [0, 1, 2], REFERENCE["prompt_ids"][:3]
    first = runner.prefill(rows, ids, [0, 0, 0]).argmax(-1).tolist()
    positions = [len(i) for i in ids]
    runner.use_adapters(0, ((slots["all7"], 1.0),))
    runner.use_adapters(2, ((slots["qv"], 0.5),))
    try:
        replayed = runner.decode(rows, first, positions).clone()
        eager = DecodeGraphs(runner.model, runner.cache, 12, runner.device, capture=False)
        adapters = [runner.row_adapters.get(r, ()) for r in rows]
        torch.testing.assert_close(replayed, eager.decode(rows, first, positions, adapters), rtol=0, atol=1e-3)
    finally:
        for r in rows:
            runner.use_adapters(r, ())
