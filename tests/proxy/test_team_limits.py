"""Per-team limits shared by every replica through a real Redis (Debian's redis-server on loopback): concurrent
requests counted by the proxies, generated tokens per minute counted by the servers, 429 with Retry-After in each
API's shape, and what a Redis outage does (each replica counts alone; the service goes on)."""

from __future__ import annotations

import logging
import uuid

import pytest
import requests
from proxy_helpers import bearer, make_token, start_mock_inference_server
from servers import RedisProcess, wait_for

from inference_api.config import ServerConfig
from lifecycle.quota import LEASE_SECONDS, RETRY_SECONDS, Store, TeamLimits, retry_after, window_rate
from proxy.app import choices_weight
from proxy.config import ProxyConfig


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_both_limits_are_on_by_default():
    assert ProxyConfig().max_concurrent_per_team == 16  # half the server's 32 rows
    assert ServerConfig().tokens_per_minute_per_team == 60000
    assert ProxyConfig().redis_url is None and ServerConfig().redis_url is None  # in-process without a URL


def test_two_replicas_share_one_teams_open_requests(redis_server):
    prefix = f"t{uuid.uuid4().hex}"
    a, b = (TeamLimits(Store(redis_server.url), max_concurrent=2) for _ in range(2))
    first, second = a.acquire(prefix + "x"), b.acquire(prefix + "x")
    assert first is not None and second is not None
    assert a.acquire(prefix + "x") is None and b.acquire(prefix + "x") is None  # the team's 2, on either replica
    assert b.acquire(prefix + "y") is not None  # another team is counted apart
    first.release()
    first.release()  # idempotent: a second release frees nothing more
    third = b.acquire(prefix + "x")
    assert third is not None and a.acquire(prefix + "x") is None
    assert a.store.fallbacks == 0 and b.store.fallbacks == 0
    unlimited = TeamLimits(Store(redis_server.url), max_concurrent=0)
    assert all(unlimited.acquire(prefix + "x") is not None for _ in range(5))


def test_a_requests_weight_is_the_rows_it_asks_for():
    """n and best_of, at the top (OpenAI, vLLM) or in TGI's parameters, as the server reads them; else 1."""
    assert choices_weight(b'{"prompt": "x", "n": 8}') == 8
    assert choices_weight(b'{"n": 2, "best_of": 3}') == 3
    assert choices_weight(b'{"inputs": "x", "parameters": {"best_of": 4, "n": 2}}') == 4
    assert choices_weight(b' {"n": "8"}') == 8 and choices_weight(b'{"n": 8.0}') == 8  # the server reads both as 8
    for body in [b"", b"n=8", b"[8]", b'"n"', b"[" * 5000, b'{"n": true}', b'{"n": 0}', b'{"n": -3}', b'{"n": 2.5}']:
        assert choices_weight(body) == 1, body
    for body in [b'{"n": null}', b'{"n": "x"}', b'{"n": "nan"}', b'{"parameters": [{"n": 5}]}', b'{"x": {"n": 5}}']:
        assert choices_weight(body) == 1, body


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
def test_a_lease_weighs_the_rows_it_asks_for(request, shared):
    """The team's held weight plus the new lease's must stay within the limit; a weighted lease is refreshed and
    given back whole."""
    redis = request.getfixturevalue("redis_server") if shared else None
    team, clock = f"t{uuid.uuid4().hex}", Clock()
    limits = TeamLimits(Store(redis.url if redis else None), max_concurrent=4, wall_clock=clock)
    three = limits.acquire(team, 3)
    assert three is not None and limits.acquire(team, 2) is None  # 3 + 2 > 4
    one = limits.acquire(team)
    assert one is not None and limits.acquire(team) is None  # 3 + 1: the limit
    assert limits.acquire(f"other-{team}", 4) is not None  # another team is counted apart
    assert limits.never_fits(team, 5) and not limits.never_fits(team, 4) and not limits.never_fits(None, 5)
    if redis:
        assert redis.client.zcard(f"inference:quota:leases:{team}") == 4
    clock.now += LEASE_SECONDS * 0.75
    limits.refresh()  # every place of the weighted lease is extended...
    clock.now += LEASE_SECONDS * 0.5
    assert limits.acquire(team) is None  # ...so none of them has expired
    three.release()
    three.release()  # idempotent
    again = limits.acquire(team, 3)
    assert again is not None and limits.acquire(team) is None
    for lease in (again, one):
        lease.release()
    assert limits.acquire(team, 4) is not None
    if redis:
        assert limits.store.fallbacks == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "redis"])
def test_n_counts_toward_the_teams_open_rows_through_the_proxy(stub, make_proxy, request, shared):
    """A request takes one of its team's places per choice: n=3 of 4 leaves room for one more row (429 beyond it),
    and n over the limit can never pass: 400 in the caller's API shape, never forwarded."""
    from test_proxy_streaming import stream_url

    flags = ["--redis-url", request.getfixturevalue("redis_server").url] if shared else []
    proxy = make_proxy(stub.url, "--max-concurrent-per-team", "4", *flags)
    team = bearer(make_token({"team_id": f"team-{uuid.uuid4().hex[:8]}", "token_id": "t"}))
    held = requests.post(  # long enough to outlast the checks; closed below, which gives its places back
        stream_url(proxy, f"n-{uuid.uuid4().hex}", chunks=60, delay=0.5),
        json={"n": 3},
        headers=team,
        stream=True,
        timeout=30,
    )
    refused = f"?refused={uuid.uuid4().hex}"  # marks the requests that must not reach the upstream
    try:
        assert held.status_code == 200
        over = requests.post(
            proxy.url + "/v1/completions" + refused, json={"prompt": "x", "n": 2}, headers=team, timeout=10
        )
        assert over.status_code == 429 and over.headers["Retry-After"] == "1"
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert requests.post(proxy.url + "/echo", json={"n": 1}, headers=team, timeout=10).status_code == 200
        assert requests.post(proxy.url + "/echo", data=b"n=9, not JSON", headers=team, timeout=10).status_code == 200
        never = requests.post(
            proxy.url + "/v1/completions" + refused, json={"prompt": "x", "n": 5}, headers=team, timeout=10
        )
        assert never.status_code == 400, never.text
        assert "n=5 exceeds the team's limit of 4 open rows" in never.json()["error"]["message"]
        tgi = requests.post(
            proxy.url + "/generate" + refused,
            json={"inputs": "x", "parameters": {"best_of": 5}},
            headers=team,
            timeout=10,
        )
        assert tgi.status_code == 422 and "limit of 4 open rows" in tgi.json()["error"]
        assert not any(refused in seen for seen in stub.seen)
    finally:
        held.close()
    assert wait_for(
        lambda: requests.post(proxy.url + "/echo", json={"n": 4}, headers=team, timeout=10).status_code == 200, 20
    ), "the weighted lease was not given back when its client went away"


def test_a_dead_replicas_leases_expire_and_a_live_ones_are_refreshed(redis_server):
    team = f"t{uuid.uuid4().hex}"
    clock = Clock()
    dead, live = (TeamLimits(Store(redis_server.url), max_concurrent=2, wall_clock=clock) for _ in range(2))
    assert dead.acquire(team) is not None  # never released: its replica dies
    kept = live.acquire(team)
    assert kept is not None and live.acquire(team) is None
    clock.now += LEASE_SECONDS * 0.75
    live.refresh()  # the live replica's refresher extends its own lease
    clock.now += LEASE_SECONDS * 0.5  # the dead one's lease has now expired, the live one's has not
    assert live.acquire(team) is not None
    assert live.acquire(team) is None


def test_the_token_quota_is_shared_and_says_when_to_retry(redis_server):
    team = f"t{uuid.uuid4().hex}"
    clock = Clock(60 * 20_000 + 30)  # half-way through a minute
    a, b = (TeamLimits(Store(redis_server.url), tokens_per_minute=100, wall_clock=clock) for _ in range(2))
    assert a.check_tokens(team) is None
    a.charge(team, 60)
    assert b.check_tokens(team) is None  # 60 of 100
    b.charge(team, 50)
    wait = a.check_tokens(team)  # 110 in this minute on the two replicas together
    assert wait is not None and wait == retry_after(110, 0, clock.now, 100)
    assert a.check_tokens(f"other-{team}") is None and a.check_tokens(None) is None
    clock.now += wait  # the window has moved on enough: under the quota again
    assert b.check_tokens(team) is None  # 110 is the previous minute's now, and only 54 of its 60 s count
    clock.now -= 1
    assert b.check_tokens(team) is not None  # a second earlier it was not yet


def test_window_arithmetic():
    start = 60 * 1000.0
    assert window_rate(10, 60, start + 30) == 10 + 30  # half the previous minute still inside the window
    assert retry_after(50, 100, start + 30, 60) == 25  # 50 + 100 * (30 - t) / 60 < 60 once t > 24
    assert retry_after(200, 0, start + 45, 100) == 46  # 15 s to the next minute, then more than half of it


def test_a_redis_outage_falls_back_to_this_replicas_counts_and_recovers(caplog):
    redis = RedisProcess()
    clock = Clock()
    store = Store(redis.url, clock=clock)
    limits = TeamLimits(store, max_concurrent=1)
    held = limits.acquire("outage-team")
    assert held is not None and store.shared
    redis.stop()
    with caplog.at_level(logging.WARNING, logger="quota"):
        other = limits.acquire("outage-other")  # answered from this process's counts: the service goes on
        assert other is not None and store.fallbacks == 1 and not store.shared
        assert limits.acquire("outage-other") is None  # ...which still limit this replica
        assert sum("Redis unreachable" in r.getMessage() for r in caplog.records) == 1  # one line per outage
        held.release()  # given back where it was taken: Redis (unreachable: it expires there)
        other.release()
        restarted = RedisProcess(redis.port)
        try:
            clock.now += RETRY_SECONDS - 1
            assert limits.acquire("outage-third") is not None and not store.shared  # not tried again yet
            clock.now += 2
            assert limits.acquire("outage-fourth") is not None and store.shared  # Redis again
            assert any("answers again" in r.getMessage() for r in caplog.records)
            assert restarted.client.zcard("inference:quota:leases:outage-fourth") == 1
        finally:
            restarted.stop()


@pytest.mark.timeout(120)
def test_two_proxies_share_a_teams_limit_and_go_on_without_redis(stub, make_proxy):
    from test_proxy_streaming import expected_body, stream_url

    redis = RedisProcess()
    try:
        a, b = (make_proxy(stub.url, "--max-concurrent-per-team", "1", "--redis-url", redis.url) for _ in range(2))
        team = make_token({"team_id": f"team-{uuid.uuid4().hex[:8]}", "token_id": "t"})
        held = requests.post(
            stream_url(a, f"shared-{uuid.uuid4().hex}", chunks=4, delay=0.5),
            headers=bearer(team),
            stream=True,
            timeout=30,
        )
        assert held.status_code == 200
        over = requests.post(b.url + "/echo", headers=bearer(team), timeout=10)  # the other replica knows
        assert over.status_code == 429 and over.headers["Retry-After"] == "1"
        assert "no room for 1 more of its limit of 1 open rows" in over.json()["message"]
        assert (
            requests.post(
                b.url + "/echo", headers=bearer(make_token({"team_id": "elsewhere", "token_id": "u"})), timeout=10
            ).status_code
            == 200
        )
        assert held.content == expected_body(4)
        assert wait_for(
            lambda: requests.post(b.url + "/echo", headers=bearer(team), timeout=10).status_code == 200, 10
        ), "the lease was not given back when the stream ended"
        redis.stop()
        for proxy in (a, b):  # Redis gone: every request still answered, counted by each proxy alone
            assert requests.post(proxy.url + "/echo", headers=bearer(team), timeout=10).status_code == 200
        assert wait_for(lambda: "Redis unreachable" in a.output(), 5)
    finally:
        redis.stop()


@pytest.mark.timeout(180)
def test_two_servers_share_a_teams_token_quota_with_429_in_each_apis_shape(redis_server):
    servers = [
        start_mock_inference_server(500, "--tokens-per-minute-per-team", "20", "--redis-url", redis_server.url)
        for _ in range(2)
    ]
    try:
        model = requests.get(servers[0].url + "/health", timeout=10).json()["model"]
        team = {"X-Team-Id": f"team-{uuid.uuid4().hex[:8]}"}
        first = requests.post(
            f"{servers[0].url}/v1/completions",
            headers=team,
            timeout=60,
            json={"model": model, "prompt": "a long enough prompt", "max_tokens": 24, "ignore_eos": True},
        )
        assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] > 20
        # the tokens are charged when the answer ends; the other server sees them through Redis
        assert wait_for(
            lambda: (
                requests.post(
                    f"{servers[1].url}/v1/completions",
                    headers=team,
                    timeout=60,
                    json={"model": model, "prompt": "x", "max_tokens": 2},
                ).status_code
                == 429
            ),
            10,
        )
        openai_style = requests.post(
            f"{servers[1].url}/v1/completions",
            headers=team,
            timeout=60,
            json={"model": model, "prompt": "x", "max_tokens": 2},
        )
        assert openai_style.status_code == 429 and 1 <= int(openai_style.headers["Retry-After"]) <= 120
        assert "quota of 20 tokens" in openai_style.json()["error"]["message"]
        tgi_style = requests.post(
            f"{servers[1].url}/generate",
            headers=team,
            timeout=60,
            json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
        )
        assert tgi_style.status_code == 429 and "quota" in tgi_style.json()["error"]
        native = requests.post(
            f"{servers[0].url}/inference/{model}", headers=team, timeout=60, json={"text": "x", "max_tokens": 2}
        )
        assert native.status_code == 429 and "Retry-After" in native.headers
        other_team = requests.post(
            f"{servers[1].url}/v1/completions",
            headers={"X-Team-Id": "someone-else"},
            timeout=60,
            json={"model": model, "prompt": "x", "max_tokens": 2},
        )
        no_team = requests.post(
            f"{servers[1].url}/v1/completions", timeout=60, json={"model": model, "prompt": "x", "max_tokens": 2}
        )
        assert other_team.status_code == 200 and no_team.status_code == 200  # only proxied teams are counted
        metrics = requests.get(servers[1].url + "/metrics", timeout=10).text
        assert "inference_quota_redis_fallbacks 0.0" in metrics
    finally:
        for server in servers:
            server.stop()
