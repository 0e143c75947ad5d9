#!/usr/bin/env python3
"""Regenerate the tiny random BERT embedding GGUFs in tests/data/gguf/ and llama.cpp's vectors for them.

    .venv/bin/python scripts/make_embedding_ggufs.py [--llama-dir DIR]

1. trains a tiny WordPiece vocabulary (lower-cased, BERT's pre-tokenizer) on tests/data/english.txt;
2. builds a random transformers ``BertModel`` (fixed seed) with a sentence-transformers mean-pooling module, and
   converts it with llama.cpp's own convert_hf_to_gguf.py to F32 and F16, and quantizes Q8_0 with llama-quantize;
3. runs ``llama-server --embedding`` on 127.0.0.1 on each file and writes, for TEXTS, its tokenization
   (``/tokenize``) and its vectors (``/v1/embeddings``: mean pooling, L2-normalized) to
   tests/data/gguf/bert-llamacpp.json;
4. builds a random DistilBERT on the same vocabulary (no token types; llama.cpp converts it as bert), F32, and
   records llama-server's vectors for it as for the others;
5. builds a random cross-encoder (``BertForSequenceClassification`` with one output) on the same vocabulary,
   converts it to bert-rerank-f32.gguf, and records ``llama-server --reranking``'s scores (``/v1/rerank``: the
   classifier's output itself) of DOCUMENTS for QUERY.

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


def convert(src: Path, tmp: Path, model_dir: Path, dst: Path, outtype: str) -> None:
    wrapper = tmp / "convert_wrapper.py"
    wrapper.write_text(ref.CONVERT_WRAPPER)
    cmd = [sys.executable, str(wrapper), str(src), str(model_dir), "--outtype", outtype, "--outfile", str(dst)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"convert failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-dir", default=str(Path.home() / ".cache" / "llama-server-peer"))
    args = ap.parse_args()
    llama_dir = Path(args.llama_dir)
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
            with ref.llama_server(llama_dir, path, 512, extra=["--embedding", "--pooling", "mean"]) as port:
                tokens = [ref._post(port, "/tokenize", {"content": t, "add_special": True})["tokens"] for t in TEXTS]
                body = {"input": TEXTS, "model": "bert"}
                data = ref._post(port, "/v1/embeddings", body)["data"]
                vectors = [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]
            reference["files"][name] = {"tokens": tokens, "vectors": vectors}
            print(f"{name}: {path.stat().st_size} bytes, {len(vectors[0])} dims", flush=True)
        distil_dir = tmp / "distilbert"
        shutil.copytree(
            model_dir,
            distil_dir,
            ignore=lambda d, names: [
                n for n in names if d == str(model_dir) and n in ("config.json", "model.safetensors")
            ],
        )
        build_distilbert(distil_dir, vocab)
        distil = OUT / "distilbert-f32.gguf"
        convert(src, tmp, distil_dir, distil, "f32")
        with ref.llama_server(llama_dir, distil, 512, extra=["--embedding", "--pooling", "mean"]) as port:
            data = ref._post(port, "/v1/embeddings", {"input": TEXTS, "model": "distilbert"})["data"]
            tokens = [ref._post(port, "/tokenize", {"content": t, "add_special": True})["tokens"] for t in TEXTS]
        reference["files"][distil.name] = {
            "tokens": tokens,
            "vectors": [d["embedding"] for d in sorted(data, key=lambda d: d["index"])],
        }
        print(f"{distil.name}: {distil.stat().st_size} bytes", flush=True)
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
