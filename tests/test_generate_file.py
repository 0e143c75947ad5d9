"""``python -m inference_api.offline.generate`` over the mock: a few hundred lines, killed halfway and run again, end
with every line answered once and in input order; bad lines get error lines in their place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from servers import ROOT, wait_for

LINES = 300
BAD = {41: "not json", 97: json.dumps({"prompt": "x", "temperature": 9}), 150: json.dumps({"text": "no prompt"})}
FLAGS = ["--mock", "--mock-tokens-per-second", "100", "--rows", "8", "--params", '{"max_tokens": 12}']


def echo(prompt: str, tokens: int) -> str:
    return (f"Echo: {prompt} — " * 4).encode()[:tokens].decode(errors="ignore")


def write_input(path: Path) -> dict[int, dict]:
    """The input file; returns the good lines by their 1-based line number."""
    good, lines = {}, []
    for i in range(LINES):
        n = len(lines) + 1
        if n in BAD:
            lines.append(BAD[n])
            continue
        obj = (
            {"prompt": f"line {n}", "id": f"q{n}"}
            if n % 5
            else {"messages": [{"role": "user", "content": f"chat {n}"}], "max_tokens": 6}
        )
        good[n] = obj
        lines.append(json.dumps(obj))
        if i == 200:
            lines.append("")  # blank lines are skipped, and still counted as lines
    path.write_text("\n".join(lines) + "\n")
    return good


def start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "inference_api.offline.generate",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out.jsonl"),
            *FLAGS,
            *extra,
        ],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_killed_halfway_and_resumed_answers_every_line_once_in_order(tmp_path):
    good = write_input(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    first = start(tmp_path)

    def halfway() -> bool:
        assert first.poll() is None, first.communicate()
        return count_lines(out) >= LINES // 3

    assert wait_for(halfway, 120), count_lines(out)
    os.killpg(first.pid, signal.SIGKILL)  # no chance to clean up
    first.wait(10)
    written = count_lines(out)
    assert LINES // 3 <= written < LINES, written  # killed before the end: the second run has lines left to answer
    with out.open("a") as f:
        f.write('{"line": 99999, "text": "cut sh')  # a line cut short by the kill is dropped on resume

    second = start(tmp_path)
    stdout, stderr = second.communicate(timeout=180)
    assert second.returncode == 0, stderr
    assert "Generating" in stderr and "req" in stderr  # the progress bar
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in records] == sorted(list(good) + list(BAD))  # each once, in input order
    for r in records:
        n = r["line"]
        if n in BAD:
            assert r["finish_reason"] == "error" and r["error"], r
            continue
        obj = good[n]
        if "messages" in obj:
            assert r["text"] == echo(f"<|user|>chat {n}\n<|assistant|>", 6) and r["completion_tokens"] == 6
            assert "id" not in r
        else:
            assert r == {
                "line": n,
                "id": f"q{n}",
                "text": echo(f"line {n}", 12),
                "finish_reason": "length",
                "prompt_tokens": len(f"line {n}"),
                "completion_tokens": 12,
            }
    assert "temperature must be a number in [0, 2]" in next(r["error"] for r in records if r["line"] == 97)

    third = start(tmp_path, "--no-progress")  # nothing left to do
    _, stderr = third.communicate(timeout=120)
    assert third.returncode == 0 and "0 line(s) written" in stderr and "Generating" not in stderr
    assert len(out.read_text().splitlines()) == len(records)
