"""Proxy fixtures: a stand-in upstream in this process, proxies as real subprocesses on loopback ports."""

from __future__ import annotations

import pytest
from proxy_helpers import start_mock_inference_server, start_proxy
from stub_upstream import StubUpstream


@pytest.fixture(scope="session")
def stub():
    with StubUpstream() as server:
        yield server


@pytest.fixture(scope="session")
def proxy(stub):
    """The proxy in front of the stand-in upstream, default settings apart from the listen port."""
    with start_proxy(stub.url) as process:
        yield process


@pytest.fixture
def make_proxy():
    """Start extra proxies with their own flags; all are stopped when the test ends."""
    started = []

    def make(upstream: str, *flags: str, **kwargs):
        process = start_proxy(upstream, *flags, **kwargs)
        started.append(process)
        return process

    yield make
    for process in started:
        process.stop()


@pytest.fixture(scope="session")
def inference_server():
    """The real inference server on its mock backend; skipped only where the inference_api package is absent."""
    try:
        import inference_api.__main__  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"inference_api not importable: {exc}")
    with start_mock_inference_server(tokens_per_second=50) as server:
        yield server


@pytest.fixture(scope="session")
def inference_proxy(inference_server):
    with start_proxy(inference_server.url) as process:
        yield process
