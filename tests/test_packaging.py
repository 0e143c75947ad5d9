"""The package as users install it: pyproject.toml's pins are requirements*.txt's; the proxy runs from
requirements-proxy.txt alone (as its image installs it); and ``pip install`` of the built wheel gives the
commands and the offline API, used from outside the checkout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import requests
from servers import ROOT, Process, free_port

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(name: str) -> set[str]:
    """A requirements file's own pins (``-r`` includes left out), inline comments dropped."""
    lines = (re.sub(r"\s+#.*", "", line).strip() for line in (ROOT / name).read_text().splitlines())
    return {line for line in lines if line and not line.startswith(("#", "-r"))}


def test_pyproject_pins_are_the_requirements_files():
    project = PYPROJECT["project"]
    assert set(project["dependencies"]) == pins("requirements-proxy.txt") | pins("requirements.txt")
    assert set(project["optional-dependencies"]["proxy"]) == pins("requirements-proxy.txt")
    assert set(project["optional-dependencies"]["test"]) == pins("requirements-test.txt")
    assert set(project["scripts"]) == {"inference-api", "inference-proxy", "inference-generate", "jwt-util"}


def fresh_venv(path: Path) -> Path:
    """A new virtual environment of the base interpreter; returns its python."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def test_the_proxy_runs_from_its_own_requirements(tmp_path):
    """gunicorn's gevent worker needs ``packaging``, which only gunicorn's gevent extra names: the proxy image,
    which installs requirements-proxy.txt alone, did not start without it."""
    python = fresh_venv(tmp_path / "venv")
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "-r",
            str(ROOT / "requirements-proxy.txt"),
        ],
        check=True,
        timeout=600,
    )
    app = tmp_path / "app"  # what the proxy image copies (Dockerfile, target proxy)
    for part in ("proxy", "lifecycle"):
        shutil.copytree(ROOT / part, app / part, ignore=shutil.ignore_patterns("__pycache__"))
    port = free_port()
    proxy = Process(
        [str(python), "-m", "proxy", "--port", str(port), "--upstream", "http://127.0.0.1:9"],
        port,
        env={"JWT_SECRET": "s" * 48},
        cwd=app,
    )
    try:
        assert requests.post(proxy.url + "/v1/completions", json={}, timeout=10).status_code == 401
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from the checkout's tracked files, installed without its dependencies into a fresh
    environment that sees this one's packages (torch and the rest are not installed twice)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in [
        *(n for n in tracked if n.split("/")[0] in ("inference_api", "proxy", "lifecycle")),
        "pyproject.toml",
        "README.md",
        "LICENSE",
    ]:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    python = fresh_venv(tmp / "venv")
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the wheel's own
    wheel = next((tmp / "dist").glob("*.whl"))
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", str(wheel)],
        check=True,
        timeout=300,
    )
    work = tmp / "elsewhere"  # outside the checkout: nothing is imported from it
    work.mkdir()
    return python.parent, work


def test_the_commands_run_from_outside_the_checkout(installed):
    bin_dir, work = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JWT_SECRET")}
    for command in ("inference-proxy", "inference-generate", "jwt-util", "inference-api"):
        out = subprocess.run(
            [str(bin_dir / command), "--help"], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
    token = subprocess.run(
        [str(bin_dir / "jwt-util"), "encode", '{"team_id": "t", "token_id": "k"}'],
        cwd=work,
        env={**env, "JWT_SECRET": "s" * 48},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert token.returncode == 0 and token.stdout.count(".") == 2
    port = free_port()
    server = Process(
        [str(bin_dir / "inference-api"), "--mock", "--port", str(port)],
        port,
        cwd=work,
        env={"SKIP_PREFLIGHT": "1", "MODEL_CACHE_DIR": str(work / "cache")},
        ready_status=200,
    )
    try:
        answer = requests.post(
            server.url + "/v1/completions",
            timeout=30,
            json={"model": server_model(server), "prompt": "hi", "max_tokens": 4},
        ).json()
        assert answer["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def server_model(server: Process) -> str:
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_the_offline_api_from_outside_the_checkout(installed):
    bin_dir, work = installed
    script = (
        "import inference_api, sys\n"
        "from inference_api import LLM, SamplingParams\n"
        f"assert inference_api.__file__.startswith({str(bin_dir.parent)!r}), inference_api.__file__\n"
        "with LLM(mock=True) as llm:\n"
        "    print(llm.generate(['hi'], SamplingParams(max_tokens=3), use_tqdm=False)[0].completion_tokens)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(bin_dir / "python"), "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.split()[-1] == "3", out.stderr[-3000:]
