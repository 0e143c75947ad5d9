"""Shared fixtures: one real-model server and one mock server per test session, on loopback."""
from __future__ import annotations

import os

import pytest

from servers import MODEL_NAME, ROOT, ServerProcess

# the converted default model is kept between runs (the same folder the serve command uses)
MODEL_CACHE = os.environ.get("MODEL_CACHE_DIR", str(ROOT / "model_cache"))


@pytest.fixture(scope="session")
def real_server():
    server = ServerProcess("--model-cache-dir", MODEL_CACHE, "--context-length", "1024", "--max-waiting", "64")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mock_server():
    server = ServerProcess("--mock", "--mock-tokens-per-second", "50", "--rows", "4", "--max-waiting", "4")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME
