#!/usr/bin/env python3
"""Regenerate the tiny random BERT embedding GGUFs in tests/data/gguf/ and llama.cpp's vectors for them.

    .venv/bin/python scripts/make_embedding_ggufs.py [--llama-dir DIR] [--decoder]

1. trains a tiny WordPiece vocabulary (lower-cased, BERT's pre-tokenizer) on tests/data/english.txt;
2. builds a random transformers ``BertModel`` (fixed seed) with a sentence-transformers mean-pooling module, and
   converts it with llama.cpp's own convert_hf_to_gguf.py to F32 and F16, and quantizes Q8_0 with llama-quantize;
3. runs ``llama-server --embedding`` on 127.0.0.1 on each file and writes, for TEXTS, its tokenization
   (``/tokenize``) and its vectors (``/v1/embeddings``: mean pooling, L2-normalized) to
   tests/data/gguf/bert-llamacpp.json;
4. builds a random DistilBERT on the same vocabulary (no token types; llama.cpp converts it as bert), F32, and
   records llama-server's vectors for it as for the others;
5. builds a random nomic-bert (nomic-embed-text's shape: fused qkv without biases, NEOX rotary instead of
   learned positions, a SwiGLU MLP; written by hand, transformers has no class for it) on the same vocabulary,
   converts it to F32 and Q8_0, and records llama-server's vectors for it as for the others;
6. builds a random cross-encoder (``BertForSequenceClassification`` with one output) on the same vocabulary,
   converts it to bert-rerank-f32.gguf, and records ``llama-server --reranking``'s scores (``/v1/rerank``: the
   classifier's output itself) of DOCUMENTS for QUERY;
7. with ``--decoder`` alone: runs ``llama-server --embedding`` on the embedded SmolLM2 file with mean and with last
   pooling and writes its vectors of TEXTS to tests/data/gguf/smollm2-embeddings-llamacpp.json (a generating
   model's --embedding).

llama.cpp comes from the peer build (``bash ../shared/peers/build-llama-server.sh``), as for
make_reference_ggufs.py, whose conversion wrapper and server helpers this reuses.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # (inference_api, for the embedded file's path)
import make_reference_ggufs as ref  # noqa: E402

OUT = ref.OUT_DIR
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A library is a collection of books and other media.",
    "hello",
    "Mountains rise above the clouds, and rivers run down to the sea, again and again.",
]
VOCAB = 512
SEED = 4321


def train_wordpiece(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train([str(ref.TEXT_FILE)], trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True)
    fast.save_pretrained(out)


def bert_config(vocab: int, **extra):
    """The tiny BERTs' shape: 64 wide, 2 layers of 4 heads, 128 positions."""
    import transformers as T

    return T.BertConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        type_vocab_size=2,
        initializer_range=0.2,
        **extra,
    )


def build_bert(out: Path, vocab: int) -> None:
    import torch
    import transformers as T

    torch.manual_seed(SEED)
    cfg = bert_config(vocab)
    model = T.BertModel(cfg, add_pooling_layer=False).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))


QUERY = "what does a library hold"
DOCUMENTS = ["A library is a collection of books and other media.", "The fox jumps over the dog.", "books", "x"]


def build_reranker(out: Path, vocab: int) -> None:
    """A random cross-encoder: BERT with one classifier output (llama.cpp keeps the first token's vector and
    the classifier; the converter drops BERT's pooler)."""
    import torch
    import transformers as T

    torch.manual_seed(SEED + 1)
    T.BertForSequenceClassification(bert_config(vocab, num_labels=1)).eval().save_pretrained(
        out, safe_serialization=True
    )


def build_distilbert(out: Path, vocab: int) -> None:
    """A random DistilBERT (no token types; llama.cpp converts it as bert) with mean pooling."""
    import torch
    import transformers as T

    torch.manual_seed(SEED + 2)
    cfg = T.DistilBertConfig(
        vocab_size=vocab,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=128,
        initializer_range=0.2,
    )
    T.DistilBertModel(cfg).eval().save_pretrained(out, safe_serialization=True)


def build_nomic(out: Path, vocab: int) -> None:
    """A random NomicBertModel with mean pooling, its tensors under the names nomic-ai's checkpoints use (the
    converter checks the config's fixed choices: SwiGLU, no biases, post-norm, full NEOX rotary)."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED + 3)
    d, ff, layers = 64, 128, 2

    def w(*shape):
        return torch.randn(*shape) * 0.2

    def norm(name):
        return {f"{name}.weight": 1 + torch.randn(d) * 0.1, f"{name}.bias": torch.randn(d) * 0.1}

    tensors = {
        "embeddings.word_embeddings.weight": w(vocab, d),
        "embeddings.token_type_embeddings.weight": w(2, d),
        **norm("emb_ln"),
    }
    for i in range(layers):
        p = f"encoder.layers.{i}."
        tensors |= {
            p + "attn.Wqkv.weight": w(3 * d, d),
            p + "attn.out_proj.weight": w(d, d),
            p + "mlp.fc11.weight": w(ff, d),
            p + "mlp.fc12.weight": w(ff, d),
            p + "mlp.fc2.weight": w(d, ff),
            **norm(p + "norm1"),
            **norm(p + "norm2"),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["NomicBertModel"],
        "model_type": "nomic_bert",
        "vocab_size": vocab,
        "n_embd": d,
        "n_layer": layers,
        "n_head": 4,
        "n_inner": ff,
        "n_positions": 8192,
        "max_trained_positions": 2048,
        "layer_norm_epsilon": 1e-12,
        "rotary_emb_base": 1000,
        "rotary_emb_fraction": 1.0,
        "rotary_emb_interleaved": False,
        "rotary_emb_scale_base": None,
        "type_vocab_size": 2,
        "activation_function": "swiglu",
        "causal": False,
        "prenorm": False,
        "qkv_proj_bias": False,
        "mlp_fc1_bias": False,
        "mlp_fc2_bias": False,
    }
    (out / "config.json").write_text(json.dumps(config))


def llama_vectors(llama_dir: Path, path: Path, model: str, pooling: str = "mean", n_ctx: int = 512) -> dict:
    """llama-server --embedding's tokens and pooled, normalized vectors of TEXTS for one file."""
    with ref.llama_server(llama_dir, path, n_ctx, extra=["--embedding", "--pooling", pooling]) as port:
        tokens = [ref._post(port, "/tokenize", {"content": t, "add_special": True})["tokens"] for t in TEXTS]
        data = ref._post(port, "/v1/embeddings", {"input": TEXTS, "model": model})["data"]
    return {"tokens": tokens, "vectors": [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]}


def convert(src: Path, tmp: Path, model_dir: Path, dst: Path, outtype: str) -> None:
    wrapper = tmp / "convert_wrapper.py"
    wrapper.write_text(ref.CONVERT_WRAPPER)
    cmd = [sys.executable, str(wrapper), str(src), str(model_dir), "--outtype", outtype, "--outfile", str(dst)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"convert failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def _weights(model_dir: Path, folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: the BERT's own config and weights (its tokenizer and pooling stay)."""
    return [n for n in names if folder == str(model_dir) and n in ("config.json", "model.safetensors")]


def decoder_vectors(llama_dir: Path) -> None:
    """llama-server --embedding's vectors of TEXTS on the embedded SmolLM2 file, pooled mean and last."""
    from inference_api.model.loader import embedded_gguf

    reference: dict = {"generator": "scripts/make_embedding_ggufs.py --decoder", "texts": TEXTS, "pooling": {}}
    for pooling in ("mean", "last"):
        got = llama_vectors(llama_dir, embedded_gguf(), "smollm2", pooling, 2048)
        reference["pooling"][pooling] = got["vectors"]
    (OUT / "smollm2-embeddings-llamacpp.json").write_text(json.dumps(reference) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-dir", default=str(Path.home() / ".cache" / "llama-server-peer"))
    ap.add_argument("--decoder", action="store_true", help="only the embedded SmolLM2 file's --embedding vectors")
    args = ap.parse_args()
    llama_dir = Path(args.llama_dir)
    if args.decoder:
        decoder_vectors(llama_dir)
        return
    src = llama_dir / "src" / "vendor" / "llama.cpp"
    tmp = Path(tempfile.mkdtemp(prefix="bertgguf-"))
    try:
        model_dir = tmp / "bert"
        train_wordpiece(model_dir)
        vocab = len(json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"])
        build_bert(model_dir, vocab)
        files = {}
        for outtype in ("f32", "f16"):
            dst = OUT / f"bert-{outtype}.gguf"
            convert(src, tmp, model_dir, dst, outtype)
            files[dst.name] = dst
        q8 = OUT / "bert-q8_0.gguf"
        subprocess.run(
            [str(llama_dir / "llama-quantize"), str(files["bert-f32.gguf"]), str(q8), "Q8_0"],
            check=True,
            capture_output=True,
        )
        files[q8.name] = q8
        reference = {"generator": "scripts/make_embedding_ggufs.py", "texts": TEXTS, "files": {}}
        for name, path in files.items():
            reference["files"][name] = llama_vectors(llama_dir, path, "bert")
            print(f"{name}: {path.stat().st_size} bytes", flush=True)
        distil_dir = tmp / "distilbert"
        shutil.copytree(model_dir, distil_dir, ignore=lambda d, names: _weights(model_dir, d, names))
        build_distilbert(distil_dir, vocab)
        distil = OUT / "distilbert-f32.gguf"
        convert(src, tmp, distil_dir, distil, "f32")
        reference["files"][distil.name] = llama_vectors(llama_dir, distil, "distilbert")
        print(f"{distil.name}: {distil.stat().st_size} bytes", flush=True)
        nomic_dir = tmp / "nomic"
        shutil.copytree(model_dir, nomic_dir, ignore=lambda d, names: _weights(model_dir, d, names))
        build_nomic(nomic_dir, vocab)
        nomic = OUT / "nomic-bert-f32.gguf"
        convert(src, tmp, nomic_dir, nomic, "f32")
        nomic_q8 = OUT / "nomic-bert-q8_0.gguf"
        quantize = [str(llama_dir / "llama-quantize"), str(nomic), str(nomic_q8), "Q8_0"]
        subprocess.run(quantize, check=True, capture_output=True)
        for path in (nomic, nomic_q8):
            reference["files"][path.name] = llama_vectors(llama_dir, path, "nomic-bert")
            print(f"{path.name}: {path.stat().st_size} bytes", flush=True)
        rerank_dir = tmp / "reranker"
        shutil.copytree(
            model_dir,
            rerank_dir,
            ignore=shutil.ignore_patterns("*.safetensors", "config.json", "modules.json", "1_Pooling"),
        )
        build_reranker(rerank_dir, vocab)
        reranker = OUT / "bert-rerank-f32.gguf"
        convert(src, tmp, rerank_dir, reranker, "f32")
        with ref.llama_server(llama_dir, reranker, 512, extra=["--reranking"]) as port:
            results = ref._post(port, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})["results"]
            pairs = [ref._post(port, "/tokenize", {"content": QUERY})["tokens"] for _ in (0,)]
        reference["rerank"] = {
            "file": reranker.name,
            "query": QUERY,
            "documents": DOCUMENTS,
            "scores": [r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])],
            "query_tokens": pairs[0],
        }
        print(f"{reranker.name}: scores {reference['rerank']['scores']}", flush=True)
        (OUT / "bert-llamacpp.json").write_text(json.dumps(reference, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
