"""The images' commands run in the project's venv exactly as the images run them (their CMD, ENV and HEALTHCHECK read
from the Dockerfile), on free loopback ports and the mock backend: `docker run -e JWT_SECRET=... IMAGE` brings up the
server (on 127.0.0.1 only) and the proxy, and a token streams an answer; without JWT_SECRET it refuses to start."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import jwt
import pytest
import requests
from image_spec import exec_form, healthcheck, local_argv, local_env, stages
from servers import ROOT, Process, free_port, wait_for

SECRET = "image-test-secret-" + "0123456789abcdef" * 3


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* shows them) with a listening socket on the port."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


@pytest.fixture(scope="module")
def stack():
    server = stages()["server"]
    ports = {"PORT": str(free_port()), "PROXY_PORT": str(free_port())}
    # the test's only changes: its ports, the proxy on loopback, the mock backend, a secret
    env = local_env(server, **ports, PROXY_HOST="127.0.0.1", MOCK_MODEL="1", MAX_USERS="4", JWT_SECRET=SECRET)
    with Process(
        local_argv(exec_form(server.last("CMD"))),
        int(ports["PROXY_PORT"]),
        env=env,
        ready_timeout=180,
        ready_status=200,
    ) as process:
        process.env = env
        process.server_port = int(ports["PORT"])
        yield process


@pytest.mark.timeout(240)
def test_with_jwt_secret_both_come_up_and_a_token_streams_an_answer(stack):
    assert requests.get(f"{stack.url}/health", timeout=10).json() == {"status": "ready"}  # public: the status only
    token = jwt.encode(
        {"team_id": "docker", "token_id": "run", "exp": int(time.time()) + 3600, "admin": True},
        SECRET,
        algorithm="HS256",
    )
    health = requests.get(f"{stack.url}/health", headers={"Authorization": f"Bearer {token}"}, timeout=10).json()
    assert health["status"] == "ready" and health["mock"] is True
    with requests.post(
        f"{stack.url}/predictions/{health['model']}",
        json={"text": "container", "max_tokens": 30},
        headers={"Authorization": f"Bearer {token}"},
        stream=True,
        timeout=60,
    ) as answer:
        assert answer.status_code == 200, answer.text
        pieces = list(answer.iter_content(chunk_size=None))
    assert len(pieces) > 1 and b"".join(pieces).startswith(b"Echo: ")
    assert (
        requests.post(f"{stack.url}/predictions/{health['model']}", json={"text": "x"}, timeout=10).status_code == 401
    )
    assert wait_for(lambda: "Ready:" in stack.output(), 30, 0.2), stack.output()[-3000:]
    assert token not in stack.output() and SECRET not in stack.output()


def test_the_server_listens_on_loopback_only(stack):
    assert listening_addresses(stack.server_port) == {"0100007F"}  # 127.0.0.1, and nothing on IPv6
    assert requests.get(f"http://127.0.0.1:{stack.server_port}/health", timeout=10).status_code == 200


def test_the_image_health_check_passes_while_both_run(stack):
    check = local_argv(healthcheck(stages()["server"]))
    result = subprocess.run(check, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(120)
def test_the_proxy_image_command_fronts_the_server(stack):
    proxy = stages()["proxy"]
    port = free_port()
    env = local_env(
        proxy,
        PROXY_PORT=str(port),
        PROXY_HOST="127.0.0.1",
        JWT_SECRET=SECRET,
        UPSTREAM_URL=f"http://127.0.0.1:{stack.server_port}",
    )
    with Process(local_argv(exec_form(proxy.last("CMD"))), port, env=env, ready_status=200) as process:
        check = subprocess.run(local_argv(healthcheck(proxy)), cwd=ROOT, env=env, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stderr
        model = requests.get(f"http://127.0.0.1:{stack.server_port}/health", timeout=10).json()["model"]
        token = jwt.encode(
            {"team_id": "docker", "token_id": "proxy", "exp": int(time.time()) + 3600}, SECRET, algorithm="HS256"
        )
        answer = requests.post(
            f"{process.url}/inference/{model}",
            json={"text": "slim", "max_tokens": 10},
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.content.startswith(b"Echo: slim")


@pytest.mark.timeout(120)
def test_docker_stop_stops_both_and_the_health_check_then_fails(stack):
    os.killpg(stack.proc.pid, signal.SIGTERM)  # what `docker stop` sends to the container's command
    try:
        code = stack.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, stack.output()[-6000:]
    for port in (stack.server_port, stack.port):
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
    check = local_argv(healthcheck(stages()["server"]))
    result = subprocess.run(check, cwd=ROOT, env=stack.env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "unhealthy" in result.stderr


@pytest.mark.timeout(60)
def test_without_jwt_secret_it_refuses_to_start_with_a_message():
    server = stages()["server"]
    ports = {"PORT": str(free_port()), "PROXY_PORT": str(free_port())}
    env_file = ROOT / ".env"
    before = env_file.read_bytes() if env_file.exists() else None
    env = local_env(server, **ports, PROXY_HOST="127.0.0.1", MOCK_MODEL="1")
    assert "JWT_SECRET" not in env
    result = subprocess.run(
        local_argv(exec_form(server.last("CMD"))), cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "JWT_SECRET is not set: refusing to start" in result.stderr
    assert (env_file.read_bytes() if env_file.exists() else None) == before  # no secret was made up
    for port in ports.values():
        assert not listening_addresses(int(port))
