"""scripts/bench.py against real servers on loopback, with tiny loads."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servers import MODEL_CACHE, ServerProcess

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


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


def test_fresh_prompts_start_with_a_tag_of_their_own_in_every_run(mock_server, monkeypatch):
    result = bench("--url", mock_server.url, "--concurrency", "2", "--max-tokens", "40", "--fresh-prompts",
                   "--api", "openai", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert len(rows(result.stdout)) == 2
    assert bench("--url", mock_server.url, "--ignore-eos").returncode != 0  # the native API has no ignore_eos
    spec = importlib.util.spec_from_file_location("bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    tagged = module.prompts(32, 0) + module.prompts(32, 1)
    assert len({p[:10] for p in tagged}) == 64 and all(p.endswith(q) for p, q in zip(tagged, module.prompts(32) * 2))


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
