"""Shared fixtures: one real-model server and one mock server per test session, on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import MODEL_CACHE, MODEL_NAME, ServerProcess, model_server


@pytest.fixture(scope="session")
def real_server():
    """The exact mode: the embedded model's weights dequantized to float32, a float32 KV cache."""
    yield from model_server("--quantize", "none", "--dtype", "float32")


@pytest.fixture(scope="session")
def quantized_server():
    """The default 4-bit weights, with a float32 KV cache and float32 matmuls for several rows (the default
    is an int8 cache and, on CPUs that multiply bfloat16, bfloat16 batches), so outputs compare with
    generate exactly."""
    yield from model_server("--kv-dtype", "float32", "--dtype", "float32")


@pytest.fixture(scope="session")
def default_server():
    """The defaults users get: the GGUF's 4-bit blocks, an int8 KV cache, int8 inputs for every row count."""
    yield from model_server()


@pytest.fixture(scope="session")
def mock_server():
    with ServerProcess("--mock", "--mock-tokens-per-second", "50", "--rows", "4", "--max-waiting", "4") as server:
        yield server


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture(scope="session")
def reference(model_dir):
    """transformers' greedy generate of the embedded model, one prompt at a time, each answer computed once for
    the whole session (greedy.greedy_reference): what every greedy test compares the servers' answers with."""
    from greedy import greedy_reference

    return greedy_reference(model_dir)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model converted into the model cache (the folder the real server loads)."""
    from inference_api.config import ServerConfig
    from inference_api.model.loader import convert_gguf, embedded_gguf, gguf_target

    gguf = embedded_gguf()
    return convert_gguf(gguf, gguf_target(ServerConfig(model_cache_dir=Path(MODEL_CACHE)), gguf))


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir):
    from inference_api.model.tokenizer import HFTokenizer

    return HFTokenizer(model_dir)


@pytest.fixture(scope="module")
def browser():
    """A headless chromium for a module's playground tests (tests/browser.py). Not for the session: while
    Playwright's sync API runs, the thread has a running event loop, and other tests' asyncio.run() fails."""
    from browser import chromium

    with chromium() as b:
        yield b


@pytest.fixture
def context(browser):
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    context.set_default_timeout(30_000)
    yield context
    context.close()
