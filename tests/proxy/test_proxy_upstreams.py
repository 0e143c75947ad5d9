"""One proxy in front of several upstreams on loopback. Three real inference servers (mock backend): requests go to
the upstream with the fewest open requests, a server killed mid-run loses no request that had not started
streaming, it is used again once it is back, and the per-team limit counts across all upstreams. Stand-in
upstreams: a 503 or a refused connection sends the request to the next upstream and rests the failed one."""

from __future__ import annotations

import base64
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from proxy_helpers import bearer, free_port, make_token, start_mock_inference_server, start_proxy
from servers import wait_for
from stub_upstream import StubUpstream

SERVER_FLAGS = ("--rows", "2", "--max-waiting", "16")
TOKENS_PER_SECOND = 20


@pytest.fixture(scope="module")
def servers():
    started = []
    try:
        with ThreadPoolExecutor(3) as pool:
            for future in [
                pool.submit(start_mock_inference_server, TOKENS_PER_SECOND, *SERVER_FLAGS) for _ in range(3)
            ]:
                started.append(future.result())
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def proxy(servers):
    with start_proxy([s.url for s in servers], "--upstream-cooldown", "1") as process:
        yield process


@pytest.fixture(scope="module")
def model(servers) -> str:
    return requests.get(servers[0].url + "/health", timeout=10).json()["model"]


def open_sessions(server) -> int:
    return requests.get(server.url + "/health", timeout=10).json()["open_sessions"]


def counts(servers) -> list[int]:
    return [open_sessions(s) for s in servers]


def all_idle(servers) -> None:
    assert wait_for(lambda: counts(servers) == [0, 0, 0]), counts(servers)


def open_stream(proxy, model, max_tokens=2000, team="team-a") -> requests.Response:
    """A long streaming answer, held open after its first bytes arrived."""
    response = requests.post(
        f"{proxy.url}/inference/{model}",
        json={"text": "spread", "max_tokens": max_tokens},
        headers=bearer(make_token(team_id=team)),
        stream=True,
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.raw.read(1)  # (an iter_content generator dropped here would close the stream)
    return response


@pytest.mark.timeout(180)
def test_each_request_goes_to_the_upstream_with_the_fewest_open_requests(servers, proxy, model):
    all_idle(servers)
    streams = []
    try:
        for _ in range(6):  # held open one after the other: 2, 2, 2
            streams.append(open_stream(proxy, model))
        assert wait_for(lambda: counts(servers) == [2, 2, 2], 30), counts(servers)

        # free one stream's server, then open a new stream: it must land there, whoever's turn it would be
        # (the same server twice in a row, then another one, so no rotation can pass by chance)
        for victim in (4, 4, 0):
            before = counts(servers)
            streams[victim].close()
            assert wait_for(lambda: sum(open_sessions(s) for s in servers) == 5, 30)
            freed = counts(servers)
            streams[victim] = open_stream(proxy, model)
            assert wait_for(lambda: sum(open_sessions(s) for s in servers) == 6, 30)
            assert counts(servers) == before, f"freed {freed}, the new stream went elsewhere"
    finally:
        for stream in streams:
            stream.close()
    all_idle(servers)


@pytest.mark.timeout(180)
def test_the_team_limit_counts_across_all_upstreams(servers, make_proxy, model):
    all_idle(servers)
    limited = make_proxy([s.url for s in servers], "--max-concurrent-per-team", "2")
    streams = [open_stream(limited, model), open_stream(limited, model)]
    try:
        assert sorted(open_sessions(s) for s in servers) == [0, 1, 1]  # on two different servers
        refused = requests.post(
            f"{limited.url}/inference/{model}",
            json={"text": "x", "max_tokens": 5},
            headers=bearer(make_token()),
            timeout=30,
        )
        assert refused.status_code == 429
        other_team = open_stream(limited, model, team="team-b")
        other_team.close()
    finally:
        for stream in streams:
            stream.close()
    all_idle(servers)


class Client:
    """One streamed request in a thread: when its first byte came, whether it ended complete, what went wrong."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.first_byte: float | None = None
        self.body = b""
        self.status: int | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with requests.post(
                self.url,
                json={"text": "kill", "max_tokens": self.max_tokens},
                stream=True,
                headers=bearer(make_token()),
                timeout=120,
            ) as response:
                self.status = response.status_code
                for piece in response.iter_content(chunk_size=None):
                    if self.first_byte is None:
                        self.first_byte = time.monotonic()
                    self.body += piece
        except requests.RequestException as exc:
            self.error = type(exc).__name__

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.error is None and len(self.body) == self.max_tokens


@pytest.mark.timeout(300)
def test_a_killed_server_loses_no_request_that_had_not_started_and_is_used_again_once_back(servers, proxy, model):
    all_idle(servers)
    url = f"{proxy.url}/inference/{model}"
    # 12 requests of 3 s each over 3 servers of 2 rows: on each server 2 stream and 2 wait for a row
    clients = [Client(url, max_tokens=3 * TOKENS_PER_SECOND) for _ in range(12)]
    assert wait_for(lambda: sum(counts(servers)) == 12, 30), counts(servers)
    assert counts(servers)[1] > 2, "the server to be killed has no waiting request"
    victim = servers[1]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    killed_at = time.monotonic()
    for client in clients:
        client.thread.join(60)
    started_before = [c for c in clients if c.first_byte is not None and c.first_byte < killed_at]
    not_started = [c for c in clients if c not in started_before]
    assert len(not_started) >= 6  # the 6 queued ones at least (2 per server)
    assert all(c.complete for c in not_started), [(c.status, c.error, len(c.body)) for c in not_started]
    cut = [c for c in clients if not c.complete]
    assert len(cut) <= 2, "only the victim's two streaming requests may be cut"
    assert all(c.error for c in cut)  # a cut stream is never passed off as complete

    # while it is down every request is answered by the others
    after = [Client(url, max_tokens=5) for _ in range(6)]
    for client in after:
        client.thread.join(60)
    assert all(c.complete for c in after), [(c.status, c.error) for c in after]

    # back on the same port: used again once its cooldown is over
    port = victim.port
    servers[1] = start_mock_inference_server(TOKENS_PER_SECOND, *SERVER_FLAGS, port=port)
    seen = len(proxy.output())
    used = rf'"upstream": ?"http://127\.0\.0\.1:{port}"'

    def used_again() -> bool:
        requests.post(url, json={"text": "back", "max_tokens": 3}, headers=bearer(make_token()), timeout=30)
        return bool(re.search(used, proxy.output()[seen:]))

    assert wait_for(used_again, 90, 0.2), "the restarted server never got a request again:\n" + proxy.output()[-3000:]


@pytest.fixture
def stubs():
    started = [StubUpstream(), StubUpstream()]
    yield started
    for stub in started:
        stub.stop()


def test_a_503_sends_the_request_to_the_next_upstream_which_is_then_preferred(stubs, make_proxy):
    busy, free = stubs
    busy.overloaded = True
    proxy = make_proxy([busy.url, free.url], "--upstream-cooldown", "30")
    for i in range(6):
        answer = requests.get(f"{proxy.url}/echo/{i}", headers=bearer(make_token()), timeout=30)
        assert answer.status_code == 200 and answer.json()["target"] == f"/echo/{i}"
    assert len(busy.seen) <= 1  # asked once (the start-up probe or the first request), then left to rest
    assert [t for t in free.seen if t.startswith("/echo/")] == [f"/echo/{i}" for i in range(6)]


def test_when_every_upstream_answers_503_the_client_gets_it_and_the_first_to_recover_serves(stubs, make_proxy):
    for stub in stubs:
        stub.overloaded = True
    proxy = make_proxy([s.url for s in stubs], "--upstream-cooldown", "30")
    answer = requests.get(f"{proxy.url}/echo/x", headers=bearer(make_token()), timeout=30)
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2"
    assert answer.json()["message"] == "overloaded"  # the server's own answer, passed on
    stubs[1].overloaded = False  # both still in their cooldown: tried all the same, never refused for it
    answer = requests.get(f"{proxy.url}/echo/y", headers=bearer(make_token()), timeout=30)
    assert answer.status_code == 200 and "/echo/y" in stubs[1].seen


def test_a_refused_connection_sends_the_request_with_its_body_to_the_next_upstream(stubs, make_proxy):
    nothing_there = f"http://127.0.0.1:{free_port()}"
    proxy = make_proxy([nothing_there, stubs[0].url], "--upstream-cooldown", "30")
    body = os.urandom(4096)
    for _ in range(3):
        answer = requests.post(f"{proxy.url}/echo", data=body, headers=bearer(make_token()), timeout=30)
        assert answer.status_code == 200 and base64.b64decode(answer.json()["body"]) == body
    everything_down = make_proxy([nothing_there], "--upstream-cooldown", "30")
    answer = requests.get(f"{everything_down.url}/echo", headers=bearer(make_token()), timeout=30)
    assert answer.status_code == 502 and "connection refused" in answer.json()["message"]


def test_a_host_name_is_looked_up_and_its_address_used_with_the_name_as_host(stubs, make_proxy):
    proxy = make_proxy([f"http://localhost:{stubs[0].port}"])
    answer = requests.get(f"{proxy.url}/echo/name", headers=bearer(make_token()), timeout=30)
    assert answer.status_code == 200
    assert dict(answer.json()["headers"])["Host"] == f"localhost:{stubs[0].port}"
    assert wait_for(lambda: f'"upstream":"http://127.0.0.1:{stubs[0].port}"' in proxy.output().replace(" ", ""), 10)
