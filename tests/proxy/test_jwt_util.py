"""scripts/jwt_util.py, run as a subprocess: encode/decode round trips, the secret from the environment only, expiry
by default, the proxy accepts its tokens."""

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


def test_round_trip_with_a_day_of_life_by_default():
    claims = '{"team_id": "tenstorrent", "token_id":"debug-test"}'
    before = int(time.time())
    encoded = run("encode", claims, env_secret=SECRET)
    assert encoded.returncode == 0, encoded.stderr
    token = encoded.stdout.strip()
    assert token.count(".") == 2 and "\n" not in token
    decoded = run("decode", token, env_secret=SECRET)
    assert decoded.returncode == 0, decoded.stderr
    out = json.loads(decoded.stdout)
    assert {k: out[k] for k in ("team_id", "token_id")} == {"team_id": "tenstorrent", "token_id": "debug-test"}
    assert before <= out["iat"] <= int(time.time()) and out["exp"] == out["iat"] + 86400


def test_the_secret_comes_from_the_environment_only():
    """A --secret flag would put the secret in the process list: there is none."""
    token = run("encode", '{"team_id": "t", "token_id": "k"}', env_secret=SECRET).stdout.strip()
    assert json.loads(run("decode", token, env_secret=SECRET).stdout)["team_id"] == "t"
    rejected = run("decode", token, env_secret="a-different-secret-of-enough-length-42")
    assert rejected.returncode == 1 and "invalid token" in rejected.stderr
    assert run("--secret", SECRET, "encode", '{"team_id": "t"}', env_secret=SECRET).returncode == 2
    assert run("encode", '{"team_id": "t"}').returncode == 2  # no secret anywhere


def test_expires_in_no_expiry_and_errors():
    before = int(time.time())
    token = run("encode", '{"team_id": "t", "token_id": "k"}', "--expires-in", "3600", env_secret=SECRET).stdout
    claims = json.loads(run("decode", token.strip(), env_secret=SECRET).stdout)
    assert before <= claims["iat"] <= int(time.time()) and claims["exp"] == claims["iat"] + 3600
    forever = run("encode", '{"team_id": "t"}', "--no-expiry", env_secret=SECRET).stdout.strip()
    assert "exp" not in json.loads(run("decode", forever, env_secret=SECRET).stdout)
    expired = run("encode", '{"team_id": "t"}', "--expires-in", "-10", env_secret=SECRET).stdout.strip()
    result = run("decode", expired, env_secret=SECRET)
    assert result.returncode == 1 and "expired" in result.stderr.lower()
    assert run("encode", "not json", env_secret=SECRET).returncode == 2


def test_the_proxy_accepts_its_tokens(proxy):
    token = run("encode", '{"team_id": "tenstorrent", "token_id": "debug-test"}', env_secret=SECRET).stdout.strip()
    response = requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10)
    assert response.status_code == 200
    assert ["X-Team-Id", "tenstorrent"] in response.json()["headers"]
    assert ["X-Token-Id", "debug-test"] in response.json()["headers"]


def test_admin_makes_an_operators_token(proxy):
    """--admin adds "admin": true, the claim the proxy asks of /metrics (a team's token gets 403)."""
    claims = '{"team_id": "ops", "token_id": "operator"}'
    admin = run("encode", claims, "--admin", env_secret=SECRET).stdout.strip()
    assert json.loads(run("decode", admin, env_secret=SECRET).stdout)["admin"] is True
    team = run("encode", claims, env_secret=SECRET).stdout.strip()
    assert "admin" not in json.loads(run("decode", team, env_secret=SECRET).stdout)
    assert requests.get(proxy.url + "/metrics", headers=bearer(admin), timeout=10).status_code == 200
    assert requests.get(proxy.url + "/metrics", headers=bearer(team), timeout=10).status_code == 403
