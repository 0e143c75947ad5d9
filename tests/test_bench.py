"""scripts/bench.py against real servers on loopback, with tiny loads."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def rows(output: str) -> dict[int, float]:
    """concurrency -> tok/s of each 'server (HTTP stream)' line."""
    found = re.findall(r"server \(HTTP stream\)\s+c=(\d+)\s+\d+ tok\s+[\d.]+s\s+([\d.]+) tok/s", output)
    return {int(c): float(tps) for c, tps in found}


def test_mock_server_figures(mock_server):
    result = bench("--url", mock_server.url, "--concurrency", "1", "2", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert "ERRORS" not in result.stdout
    figures = rows(result.stdout)
    assert set(figures) == {1, 2} and all(tps > 0 for tps in figures.values())
    assert "TTFT p50" in result.stdout and "ITL p50" in result.stdout


def test_real_server_with_baseline_counts_model_tokens(real_server):
    result = bench("--url", real_server.url, "--concurrency", "1", "--max-tokens", "4", "--baseline")
    assert result.returncode == 0, result.stderr
    assert re.search(r"c=1\s+4 tok", result.stdout), result.stdout  # 4 tokens asked for, 4 counted
    assert re.search(r"generate \(in-process\)\s+b=32\s+\d+ tok", result.stdout)
    assert re.search(r"ratio: server c=1 / generate b=1 = [\d.]+", result.stdout)


def test_refuses_non_loopback_addresses():
    result = bench("--url", "http://192.0.2.1:8000")
    assert result.returncode != 0 and "refusing" in result.stderr
