"""scripts/bench.py against real servers on loopback, with tiny loads."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from servers import MODEL_CACHE, ServerProcess

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
GGUF_DIR = Path(__file__).resolve().parent / "data" / "gguf"
ONE_STREAM = (
    r"one stream, {}: ([\d.]+) MB read per token, ([\d.]+) tok/s = ([\d.]+) GB/s of ([\d.]+) GB/s probe "
    r"\(ceiling (\d+) tok/s, (\d+) % of it\)"
)
PROBE = r"read-bandwidth probe \((start|end)\): ([\d.]+) GB/s reading ([\d.]+) GiB"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def rows(output: str) -> list[tuple[int, float]]:
    """(concurrency, tok/s) of each 'server (HTTP stream)' line."""
    found = re.findall(r"server \(HTTP stream\)\s+c=(\d+)\s+\d+ tok\s+[\d.]+s\s+([\d.]+) tok/s", output)
    return [(int(c), float(tps)) for c, tps in found]


def test_mock_server_figures(mock_server):
    result = bench("--url", mock_server.url, "--concurrency", "1", "2", "--max-tokens", "8", "--repeat", "2")
    assert result.returncode == 0, result.stderr
    assert "ERRORS" not in result.stdout
    figures = rows(result.stdout)
    assert len(figures) == 6 and all(tps > 0 for _, tps in figures)  # 2 runs of each, then the medians
    assert "medians of 2 run(s)" in result.stdout
    assert "TTFT p50" in result.stdout and "ITL p50" in result.stdout
    assert re.search(r"engine memory: [\d.]+ GiB resident, peak [\d.]+ GiB", result.stdout)
    # the whole server: gunicorn's first process, the web worker, the engine and multiprocessing's tracker
    found = re.search(r"server memory \(all (\d+) processes, proportional\): ([\d.]+) GiB", result.stdout)
    assert found and int(found[1]) == 4 and float(found[2]) > 0, result.stdout
    # the engine's decode steps by rows, per load and over all runs: one stream's steps decode one row
    assert re.search(r"decode steps\s+c=1\s+1 row [\d.]+ ms \(\d+ steps\)", result.stdout), result.stdout
    assert re.search(r"decode step time\s+c=1\s+1 row [\d.]+ ms \(\d+ steps\)$", result.stdout, re.M)
    assert re.search(r"decode step time\s+c=2\s+.*\b2 rows [\d.]+ ms", result.stdout)
    assert re.search(ONE_STREAM.format("server"), result.stdout), result.stdout  # the medians' one-stream line


@pytest.fixture
def module(monkeypatch):
    """scripts/bench.py imported as a module."""
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    loaded = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench", loaded)  # its dataclasses look their module up
    spec.loader.exec_module(loaded)
    return loaded


def write_gguf(path: Path, vocab: int, dim: int, head: bool) -> None:
    """A GGUF of float32 tensors: the token embedding table, one layer's weight and, with head, its own output head."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((vocab, dim), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((dim, dim), np.float32))
    if head:
        writer.add_tensor("output.weight", np.ones((vocab, dim), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_decode_bytes_count_one_embedding_row_unless_the_head_is_tied(module, tmp_path):
    write_gguf(tmp_path / "untied.gguf", vocab=10, dim=4, head=True)
    write_gguf(tmp_path / "tied.gguf", vocab=10, dim=4, head=False)
    # untied: one row of the table (4 floats), the layer (16), the head (40); tied: the table whole is the head
    assert module.decode_bytes(tmp_path / "untied.gguf") == (4 + 16 + 40) * 4
    assert module.decode_bytes(tmp_path / "tied.gguf") == (40 + 16) * 4


@pytest.mark.parametrize(
    "name, tied", [("llama-q4_0", False), ("mistral-q4_k_m", False), ("qwen2-q4_k_m", True), ("gemma3-q4_k_m", True)]
)
def test_decode_bytes_of_quantized_files(module, name, tied):
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(GGUF_DIR / f"{name}.gguf")).tensors}
    assert ("output.weight" not in tensors) == tied
    embd = tensors.pop("token_embd.weight")
    row = embd // 512  # the tiny models' vocabulary: 512 tokens
    assert module.decode_bytes(GGUF_DIR / f"{name}.gguf") == sum(tensors.values()) + (embd if tied else row)


def test_decode_bytes_of_the_embedded_model(module):
    """The embedded SmolLM2 ties its head to the table: the step reads the whole file's tensors, ~97 MB."""
    gguf, _ = module.served_gguf(None, {"model": "SmolLM2-135M-Instruct"})
    if gguf is None:
        pytest.skip("the embedded model's wheel is not installed")
    n = module.decode_bytes(gguf)
    assert 90e6 < n < 100e6 and n < gguf.stat().st_size
    assert module.served_gguf(None, {"model": "another"})[0] is None  # another model: only --gguf says its file
    assert module.step_bytes(GGUF_DIR / "README.md", "") is None  # not a GGUF: unknown, never an error


def cpuinfo(vendor: str, family: int, model: int) -> str:
    return f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: X\n"


@pytest.mark.parametrize(
    "vendor, family, model, core",
    [
        ("AuthenticAMD", 25, 1, "family 25 model 1 (Zen 3)"),  # EPYC 7003 (Milan)
        ("AuthenticAMD", 25, 17, "family 25 model 17 (Zen 4)"),  # EPYC 9004 (Genoa)
        ("AuthenticAMD", 25, 160, "family 25 model 160 (Zen 4)"),  # Bergamo
        ("AuthenticAMD", 26, 2, "family 26 model 2 (Zen 5)"),  # EPYC 9005 (Turin)
        ("AuthenticAMD", 23, 49, "family 23 model 49 (Zen 2)"),  # EPYC 7002 (Rome)
        ("GenuineIntel", 6, 143, "family 6 model 143"),  # Sapphire Rapids: the numbers alone
    ],
)
def test_the_cpu_line_names_the_core_by_its_family_and_model(module, vendor, family, model, core):
    """A virtual machine's model name is often "AMD EPYC" alone: the bench names the core from the family and
    model numbers, so that runs on different machines are not taken for one."""
    assert module.cpu_core(cpuinfo(vendor, family, model)) == core
    assert module.cpu_core("flags\t: avx2\n") == ""  # no numbers: nothing said
    assert "avx_vnni" in module.CPU_FLAGS  # a Zen 5 has it, a Zen 4 not


def test_read_bandwidth_probe_gives_a_positive_figure(module):
    gbps = module.read_bandwidth(64 * 2**20, budget_s=0.5, repeats=2)
    assert gbps > 0 and math.isfinite(gbps)
    size = module.probe_size(10**9)
    assert 64 * 2**20 <= size <= 8 * 2**30


def test_one_stream_against_the_read_bandwidth_for_server_and_peer(mock_server):
    """The mock stands in for the peer too; both are measured against the embedded model's bytes."""
    result = bench("--url", mock_server.url, "--peer-url", mock_server.url, "--concurrency", "1", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    probes = re.findall(PROBE, result.stdout)
    assert [w for w, _, _ in probes] == ["start", "end"] and all(float(g) > 0 for _, g, _ in probes), result.stdout
    best = max(float(g) for _, g, _ in probes)
    for label in ("server", "peer"):
        m = re.search(ONE_STREAM.format(label), result.stdout)
        assert m, result.stdout
        mb, tps, gbps, probe, ceiling, _ = map(float, m.groups())
        assert 90 < mb < 100 and tps > 0 and probe == best
        assert math.isclose(gbps, tps * mb / 1e3, rel_tol=0.05, abs_tol=0.06)
        assert math.isclose(ceiling, probe * 1e3 / mb, rel_tol=0.01, abs_tol=1.5)


def test_unknown_decode_bytes_leave_the_figures_out(mock_server):
    result = bench("--url", mock_server.url, "--concurrency", "1", "--max-tokens", "4", "--gguf", "/nonexistent.gguf")
    assert result.returncode == 0, result.stderr
    assert "decode step bytes unknown" in result.stdout and "one stream," not in result.stdout
    assert len(rows(result.stdout)) == 2


def test_fresh_prompts_start_with_a_tag_of_their_own_in_every_run(mock_server, monkeypatch):
    result = bench(
        "--url",
        mock_server.url,
        "--concurrency",
        "2",
        "--max-tokens",
        "40",
        "--fresh-prompts",
        "--api",
        "openai",
        "--ignore-eos",
    )
    assert result.returncode == 0, result.stderr
    assert len(rows(result.stdout)) == 2
    assert bench("--url", mock_server.url, "--ignore-eos").returncode != 0  # the native API has no ignore_eos
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    tagged = module.prompts(32, 0) + module.prompts(32, 1)
    assert len({p[:10] for p in tagged}) == 64 and all(p.endswith(q) for p, q in zip(tagged, module.prompts(32) * 2))


def test_a_temperature_reaches_the_server(mock_server):
    """--temperature samples instead of the greedy answers (an out-of-range one is the server's 400, so the value is
    what the requests carry); it needs the OpenAI API."""
    args = ("--url", mock_server.url, "--concurrency", "2", "--max-tokens", "8", "--api", "openai", "--top-p", "0.9")
    sampled = bench(*args, "--temperature", "0.8")
    assert sampled.returncode == 0, sampled.stderr
    assert "ERRORS" not in sampled.stdout and len(rows(sampled.stdout)) == 2  # the run and its medians
    assert "ERRORS" in bench(*args, "--temperature", "3").stdout  # OpenAI's range ends at 2
    assert bench("--url", mock_server.url, "--temperature", "0.8").returncode != 0  # not the native API


def test_real_server_with_baseline_counts_model_tokens(real_server):
    result = bench("--url", real_server.url, "--concurrency", "1", "32", "--max-tokens", "4", "--baseline")
    assert result.returncode == 0, result.stderr
    assert re.search(r"c=1\s+4 tok", result.stdout), result.stdout  # 4 tokens asked for, 4 counted
    assert re.search(r"c=32\s+128 tok", result.stdout), result.stdout
    assert re.search(r"generate \(in-process\)\s+b=32\s+\d+ tok", result.stdout)
    for c in (1, 32):
        assert re.search(rf"ratio: server c={c} / generate b={c} = [\d.]+ / [\d.]+ = [\d.]+", result.stdout)


def test_refuses_non_loopback_addresses():
    result = bench("--url", "http://192.0.2.1:8000")
    assert result.returncode != 0 and "refusing" in result.stderr


def test_offline_throughput_next_to_http(mock_server):
    result = bench("--url", mock_server.url, "--concurrency", "4", "--max-tokens", "8", "--offline")
    assert result.returncode == 0, result.stderr
    assert re.search(r"offline \(Python API\)\s+c=4\s+32 tok", result.stdout), result.stdout  # 4 x 8 tokens
    assert re.search(r"ratio: offline c=4 / server c=4 = [\d.]+ / [\d.]+ = [\d.]+", result.stdout)


@pytest.fixture(scope="module")
def small_default_server():
    """The embedded model with its default precision (int8 cache), few rows and a short context: filling
    every row's context is 2,000 tokens of prefill instead of the shared servers' 32,000."""
    server = ServerProcess("--model-cache-dir", MODEL_CACHE, "--rows", "8", "--context-length", "256")
    yield server
    server.stop()


def test_fill_context_fills_every_row_and_reports_the_engines_memory(small_default_server):
    result = bench("--url", small_default_server.url, "--concurrency", "1", "--max-tokens", "4", "--fill-context")
    assert result.returncode == 0, result.stderr
    assert re.search(r"every row's context\s+c=8\s+\d+ tok", result.stdout), result.stdout
    assert "ERRORS" not in result.stdout
    before, filled = re.findall(r"engine memory(?:, every row's context filled)?: ([\d.]+) GiB resident", result.stdout)
    assert float(filled) > float(before)  # the lazily resident cache took its pages
    whole = re.search(
        r"server memory, every row's context filled \(all 4 processes, proportional\): ([\d.]+) GiB", result.stdout
    )
    assert whole and float(whole[1]) > float(filled) * 0.9, result.stdout  # (proportional: shared pages split)


def test_prefill_times_a_fresh_long_prompt(small_default_server):
    result = bench("--url", small_default_server.url, "--concurrency", "1", "--max-tokens", "2", "--prefill", "120")
    assert result.returncode == 0, result.stderr
    found = re.search(r"prefill 120 tokens  server median ([\d.]+) s = (\d+) tok/s \(3 runs\)", result.stdout)
    assert found and float(found.group(1)) > 0, result.stdout


def test_the_perplexity_script_scores_llama_perplexitys_chunks(real_server):
    """scripts/perplexity.py: the text's tokens after the model's BOS (none for SmolLM2), ctx at a time, the
    second half of each chunk scored, and a perplexity an English text gets from a model that reads English."""
    import requests

    spec = importlib.util.spec_from_file_location("perplexity", SCRIPT.with_name("perplexity.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.TEXT.read_text()
    model = requests.get(f"{real_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    tokenize = lambda s, special: requests.post(  # noqa: E731
        f"{real_server.url}/tokenize", json={"model": model, "prompt": s, "add_special_tokens": special}, timeout=60
    ).json()["tokens"]
    ids = tokenize(text, False)
    assert tokenize("The", True) == tokenize("The", False)  # SmolLM2 adds no BOS: its chunks are the text's tokens
    assert module.chunks(real_server.url, model, text, 64, 2) == [ids[:64], ids[64:128]]
    script = str(SCRIPT.with_name("perplexity.py"))
    result = subprocess.run(
        [sys.executable, script, "--url", real_server.url, "--ctx", "64", "--chunks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    found = re.search(r"server: PPL ([\d.]+) over 62 positions", result.stdout)
    assert found and 2 < float(found.group(1)) < 60, result.stdout
