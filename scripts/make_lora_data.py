#!/usr/bin/env python3
"""Regenerate tests/data/lora/: a tiny random llama, random LoRA adapters for it, and llama-server's greedy answers.

    .venv/bin/python scripts/make_lora_data.py [--llama-dir DIR] [--peft-pkgs DIR]

What it does (intermediate files in a temporary directory, removed afterwards):

1. trains the tiny byte-level BPE tokenizer of make_reference_ggufs.py and builds a random llama (2 layers, hidden
   64, 4 query heads and 2 key/value heads) tamed as that script tames its models (scale_qk, calibrate), converts
   it with llama.cpp's convert_hf_to_gguf.py and quantizes it to Q8_0 (base-q8_0.gguf: the int8 kernels' exact
   path, where rows are batch-invariant);
2. makes ADAPTERS with the ``peft`` package (not a dependency of the project: installed apart, by default in
   /tmp/peft-pkgs: ``.venv/bin/python -m pip install --target /tmp/peft-pkgs peft==0.21.2 --no-deps``), their A
   and B random and large enough to change greedy answers, saved as PEFT folders (<name>/) and converted by
   llama.cpp's convert_lora_to_gguf.py to f32 GGUFs (<name>.gguf);
3. asks llama-server (127.0.0.1 only) with every adapter loaded (``--lora`` each, ``--lora-init-without-apply``) for
   the greedy tokens of PROMPTS under each of CASES (a per-request ``lora`` list of {id, scale}; none: the base),
   written to llamacpp.json with the prompts' token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import make_reference_ggufs as ref  # noqa: E402

OUT = ref.DATA / "lora"
N_PREDICT = 8
# (name, PEFT LoraConfig arguments); B's entries are drawn with std B_STD (PEFT starts B at zero: no change)
ADAPTERS = [
    (
        "all7",
        dict(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ),
    ("qv", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
    (
        "mlp",
        dict(
            r=4,
            lora_alpha=4,
            target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
        ),
    ),
]
A_STD, B_STD = 0.3, 0.3
# requests: each a list of (adapter, scale); [] is the base model
CASES = [[], [("all7", 1.0)], [("all7", 0.5)], [("qv", 1.0)], [("mlp", 1.0)], [("qv", 1.0), ("mlp", 0.7)]]
PROMPTS = [
    "The cat",
    "Once upon a time",
    "In the morning the",
    "She said that",
    "The river",
    "A small house",
    "He went to the",
    "The old man and",
    "Every day",
    "The city was",
    "They found a",
    "It was a",
]
DEFAULT_PEFT_PKGS = "/tmp/peft-pkgs"


def base_model(tok_dir: Path, vocab: int):
    """The random llama, tamed as make_reference_ggufs.py's models are."""
    import torch
    import transformers as T

    from inference_api.model.families import FAMILIES

    torch.manual_seed(ref.SEED)
    cfg = T.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=ref.INIT * 4,  # (hidden 64: a larger init keeps the layers' share of the answer)
    )
    model = T.LlamaForCausalLM(cfg).eval()
    family = FAMILIES["llama"]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.mul_(ref.EMB_SCALE)
        model.lm_head.weight.add_(emb[torch.randperm(emb.shape[0])] * ref.HEAD_COPY)
        ref.scale_qk(model, family, ref.QK_SCALE)
    ref.calibrate(model, family, tok_dir)
    return model


def make_adapter(model, name: str, kwargs: dict, out: Path, seed: int) -> None:
    """A PEFT LoRA of the model, A and B random, saved in out."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kwargs))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if ".lora_A." in n:
                p.normal_(0.0, A_STD)
            elif ".lora_B." in n:
                p.normal_(0.0, B_STD)
    peft_model.save_pretrained(out)
    (out / "adapter_model.safetensors").chmod(0o644)
    peft_model.unload()  # the base model back as it was, for the next adapter
    for extra in ("README.md",):
        (out / extra).unlink(missing_ok=True)
    print(f"adapter {name}: {sorted(p.name for p in out.iterdir())}", file=sys.stderr)


LORA_WRAPPER = r"""
import sys, runpy
src = sys.argv.pop(1)
sys.path.insert(0, src + "/gguf-py")
sys.path.insert(0, src)
sys.argv = ["convert_lora_to_gguf.py"] + sys.argv[1:]
runpy.run_path(src + "/convert_lora_to_gguf.py", run_name="__main__")
"""


def convert_lora(src: Path, folder: Path, base: Path, out: Path, tmp: Path) -> None:
    wrapper = tmp / "convert_lora_wrapper.py"
    wrapper.write_text(LORA_WRAPPER)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [
        sys.executable,
        str(wrapper),
        str(src),
        str(folder),
        "--base",
        str(base),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert_lora_to_gguf failed for {folder}:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")


def server_answers(llama_dir: Path, base: Path, prompts: list[list[int]]) -> list[dict]:
    """llama-server's greedy tokens for every prompt under every case (its per-request lora list)."""
    names = [n for n, _ in ADAPTERS]
    extra = [a for n in names for a in ("--lora", str(OUT / f"{n}.gguf"))] + ["--lora-init-without-apply", "-np", "1"]
    out = []
    with ref.llama_server(llama_dir, base, 512, extra) as port:
        for case in CASES:
            tokens = []
            for ids in prompts:
                body = {
                    "prompt": ids,
                    "n_predict": N_PREDICT,
                    "temperature": 0.0,
                    "top_k": 1,
                    "cache_prompt": False,
                    "return_tokens": True,
                    # every adapter's scale (0: off): one left out keeps its --lora scale of 1, even with
                    # --lora-init-without-apply
                    "lora": [{"id": i, "scale": dict(case).get(n, 0.0)} for i, n in enumerate(names)],
                }
                tokens.append(ref._post(port, "/completion", body)["tokens"])
            out.append({"lora": [[n, s] for n, s in case], "tokens": tokens})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--llama-dir", default=os.environ.get("LLAMA_SERVER_DIR", str(Path.home() / ".cache/llama-server-peer"))
    )
    ap.add_argument("--peft-pkgs", default=os.environ.get("PEFT_PKGS", DEFAULT_PEFT_PKGS))
    args = ap.parse_args()
    sys.path.append(args.peft_pkgs)
    llama_dir = Path(args.llama_dir)
    src = llama_dir / "src" / "vendor" / "llama.cpp"
    from transformers import AutoTokenizer

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = tmp / "base"
        model_dir.mkdir()
        vocab = ref.train_tokenizer(model_dir)
        model = base_model(model_dir, vocab)
        model.save_pretrained(model_dir)
        f32 = tmp / "base-f32.gguf"
        ref.convert(src, model_dir, f32, tmp, "lora-base")
        ref.quantize(llama_dir, f32, OUT / "base-q8_0.gguf", "Q8_0")
        for i, (name, kwargs) in enumerate(ADAPTERS):
            make_adapter(model, name, kwargs, OUT / name, ref.SEED + 1 + i)
            convert_lora(src, OUT / name, model_dir, OUT / f"{name}.gguf", tmp)
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        cases = server_answers(llama_dir, OUT / "base-q8_0.gguf", prompts)
    reference = {
        "note": "greedy tokens of llama-server (-np 1, --lora-init-without-apply, a per-request lora list) for each "
        "prompt (its token ids, BOS first) under each case; made by scripts/make_lora_data.py",
        "llama_cpp": ref.llama_cpp_version(llama_dir),
        "n_predict": N_PREDICT,
        "adapters": {n: kw for n, kw in ADAPTERS},
        "prompts": PROMPTS,
        "prompt_ids": prompts,
        "cases": cases,
    }
    (OUT / "llamacpp.json").write_text(json.dumps(reference, indent=1) + "\n")
    sizes = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({sizes / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
