"""scripts/jwt_util.py, run as a subprocess: encode/decode round trips, secret precedence, expiry, the proxy accepts it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import requests

from proxy_helpers import ROOT, SECRET, bearer

SCRIPT = ROOT / "scripts" / "jwt_util.py"


def run(*args: str, env_secret: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
    if env_secret is not None:
        env["JWT_SECRET"] = env_secret
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_is_an_executable_script():
    assert os.access(SCRIPT, os.X_OK)
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")


def test_round_trip_in_the_original_form():
    claims = '{"team_id": "tenstorrent", "token_id":"debug-test"}'
    encoded = run("--secret", SECRET, "encode", claims)
    assert encoded.returncode == 0, encoded.stderr
    token = encoded.stdout.strip()
    assert token.count(".") == 2 and "\n" not in token
    decoded = run("--secret", SECRET, "decode", token)
    assert decoded.returncode == 0, decoded.stderr
    assert json.loads(decoded.stdout) == {"team_id": "tenstorrent", "token_id": "debug-test"}


def test_secret_from_environment_and_flag_wins():
    other = "a-different-secret-of-enough-length-42"
    token = run("encode", '{"team_id": "t", "token_id": "k"}', env_secret=SECRET).stdout.strip()
    assert json.loads(run("decode", token, env_secret=SECRET).stdout)["team_id"] == "t"
    flagged = run("--secret", other, "encode", '{"team_id": "t", "token_id": "k"}', env_secret=SECRET).stdout.strip()
    assert run("decode", flagged, env_secret=other).returncode == 0
    rejected = run("decode", flagged, env_secret=SECRET)
    assert rejected.returncode == 1 and "invalid token" in rejected.stderr
    assert run("decode", flagged, "--secret", other, env_secret=SECRET).returncode == 0  # flag after the command


def test_expires_in_and_errors():
    before = int(time.time())
    token = run("--secret", SECRET, "encode", '{"team_id": "t", "token_id": "k"}', "--expires-in", "3600").stdout
    claims = json.loads(run("--secret", SECRET, "decode", token.strip()).stdout)
    assert before <= claims["iat"] <= int(time.time()) and claims["exp"] == claims["iat"] + 3600
    expired = run("--secret", SECRET, "encode", '{"team_id": "t"}', "--expires-in", "-10").stdout.strip()
    result = run("--secret", SECRET, "decode", expired)
    assert result.returncode == 1 and "expired" in result.stderr.lower()
    assert run("encode", '{"team_id": "t"}').returncode == 2  # no secret anywhere
    assert run("--secret", SECRET, "encode", "not json").returncode == 2
    assert run("--secret", SECRET, "encode", "[1, 2]").returncode == 2


def test_the_proxy_accepts_its_tokens(proxy):
    token = run("--secret", SECRET, "encode", '{"team_id": "tenstorrent", "token_id": "debug-test"}').stdout.strip()
    response = requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10)
    assert response.status_code == 200
    assert ["X-Team-Id", "tenstorrent"] in response.json()["headers"]
    assert ["X-Token-Id", "debug-test"] in response.json()["headers"]
