"""The README's run command: server and proxy together, a first-run secret, a curl line that works, Ctrl-C."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import jwt
import pytest
import requests
from servers import ROOT, free_port


@pytest.fixture
def stack(tmp_path):
    server_port, proxy_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
    env["PYTHONUNBUFFERED"] = "1"
    env_file = tmp_path / ".env"
    proc = subprocess.Popen(
        [
            sys.executable,
            "scripts/run_stack.py",
            "--server-port",
            str(server_port),
            "--proxy-port",
            str(proxy_port),
            "--proxy-host",
            "127.0.0.1",
            "--env-file",
            str(env_file),
            "--mock",
            "--rows",
            "4",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # as a script's background job starts it (`cmd &` ignores SIGINT), whatever runs the tests
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    # the stack's output is read to its end on a thread: a pipe nobody reads fills up (64 KiB of logs) and
    # blocks the children's writes, so they could never finish their drain
    lines, ready = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C drains and stops"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(120)
    proc.lines = lines
    yield proc, "".join(lines), env_file, server_port, proxy_port
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def test_first_run_writes_a_secret_prints_a_working_curl_and_ctrl_c_stops_both(stack):
    proc, output, env_file, server_port, proxy_port = stack
    assert "Ready:" in output, output
    secret = re.fullmatch(r"JWT_SECRET=(\S+)\n", env_file.read_text()).group(1)
    assert len(secret) >= 32
    assert env_file.stat().st_mode & 0o777 == 0o600  # the secret's file: its owner's alone

    command = output[output.index("curl -N") : output.index("\n\nOr chat in a browser")]
    token = re.search(r"Bearer (\S+)'", command).group(1)
    assert {"team_id", "token_id", "exp"} <= set(jwt.decode(token, secret, algorithms=["HS256"]))
    assert f"127.0.0.1:{proxy_port}/predictions/" in command
    if shutil.which("curl"):
        pasted = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert pasted.returncode == 0 and pasted.stdout.startswith("Echo: "), pasted
    page = re.search(r"Or chat in a browser: (http://\S+/) ", output).group(1)
    assert page == f"http://127.0.0.1:{proxy_port}/"
    answer = requests.get(page, timeout=10)  # the playground needs no token to load
    assert answer.status_code == 200 and "Chat playground" in answer.text
    url = f"http://127.0.0.1:{proxy_port}/predictions/SmolLM2-135M-Instruct"
    assert requests.post(url, json={"text": "hi"}, timeout=10).status_code == 401  # no token: no answer

    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, "".join(proc.lines[-60:])
    for port in (server_port, proxy_port):
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
