"""The token quota reserves a request's most possible cost on admission and settles it when the answer ends (in this
process and in a real redis-server on loopback), so a burst overshoots the quota by at most one reservation; and a
team's open requests take at most --max-places-per-team of a server's rows and queue places, n choices counting n."""

from __future__ import annotations

import threading
import uuid

import pytest
import requests
from servers import MODEL_NAME, RedisProcess, ServerProcess, wait_for

from inference_api.config import ServerConfig
from lifecycle.quota import PROMPT_TOKEN_WEIGHT, RETRY_SECONDS, Reservation, Store, TeamLimits, retry_after
from proxy.config import ProxyConfig


class Clock:
    def __init__(self, now: float = 60 * 30_000 + 30.0):  # half-way through a minute
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_server():
    with RedisProcess() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
def store_url(request):
    """None (this process's counts) or a real Redis's URL."""
    return request.getfixturevalue("redis_server").url if request.param == "redis" else None


def tokens(limits: TeamLimits, team: str, now: float) -> tuple[int, int]:
    """The team's (this minute, the previous minute) buckets."""
    return limits.store.call("tokens", team, now)


def test_the_defaults():
    assert ServerConfig().prompt_token_weight == PROMPT_TOKEN_WEIGHT == 0.25
    assert ServerConfig().max_places_per_team == ProxyConfig().max_concurrent_per_team == 16
    env = {"PROMPT_TOKEN_WEIGHT": "0.5", "MAX_PLACES_PER_TEAM": "0"}
    assert ServerConfig.from_env(env).prompt_token_weight == 0.5 and ServerConfig.from_env(env).max_places_per_team == 0
    flags = ServerConfig.from_args(["--prompt-token-weight", "1", "--max-places-per-team", "4"], {})
    assert flags.prompt_token_weight == 1.0 and flags.max_places_per_team == 4
    limits = TeamLimits(Store(None), tokens_per_minute=100)
    assert limits.cost(2400, 10) == 2400 + 3  # a prompt token a quarter of a generated one, rounded up
    with pytest.raises(ValueError):
        TeamLimits(Store(None), prompt_token_weight=-1)


def test_reserve_refuses_at_the_quota_and_settles_once(store_url):
    team, clock = f"t{uuid.uuid4().hex}", Clock()
    limits = TeamLimits(Store(store_url), tokens_per_minute=1000, wall_clock=clock)
    first, second = limits.reserve(team, 600), limits.reserve(team, 600)
    assert isinstance(first, Reservation) and isinstance(second, Reservation)  # 600 < 1000 when the second came
    assert tokens(limits, team, clock.now) == (1200, 0)
    wait = limits.reserve(team, 10)  # 1200 reserved: at or over the quota
    assert wait == retry_after(1200, 0, clock.now, 1000)
    assert limits.check_tokens(team) == wait
    first.settle(100)  # 600 back, 100 counted
    first.settle(100)  # idempotent
    first.settle(5000)
    assert tokens(limits, team, clock.now) == (700, 0)
    assert isinstance(limits.reserve(team, 10), Reservation)  # 700 < 1000 again
    second.settle(0)
    assert tokens(limits, team, clock.now) == (110, 0)
    for uncounted in (limits.reserve(None, 10**9), TeamLimits(Store(store_url)).reserve(team, 10**9)):
        assert isinstance(uncounted, Reservation) and uncounted.limits is None  # no team or no quota
        uncounted.settle(10**9)
    assert tokens(limits, team, clock.now) == (110, 0) and limits.store.fallbacks == 0


def test_the_refund_goes_to_the_reservations_minute(store_url):
    team, clock = f"t{uuid.uuid4().hex}", Clock(60 * 40_000 + 50)
    limits = TeamLimits(Store(store_url), tokens_per_minute=1000, wall_clock=clock)
    reservation = limits.reserve(team, 500)
    assert isinstance(reservation, Reservation)
    clock.now += 20  # 10 s into the next minute: the reservation is the previous minute's
    assert tokens(limits, team, clock.now) == (0, 500)
    reservation.settle(120)
    assert tokens(limits, team, clock.now) == (120, 0)  # given back there, the actual cost counted now
    old = limits.reserve(team, 300)
    assert isinstance(old, Reservation)
    clock.now += 120  # two minutes on: its bucket is outside the window, nothing to give back
    old.settle(40)
    assert tokens(limits, team, clock.now) == (40, 0)


def test_a_burst_of_reservations_from_threads_overshoots_by_at_most_one(store_url):
    team, clock = f"t{uuid.uuid4().hex}", Clock()
    store = Store(store_url)  # two replicas: over one Redis, or (without) one process's counts
    replicas = [
        TeamLimits(s, tokens_per_minute=1000, wall_clock=clock)
        for s in (store, store if store_url is None else Store(store_url))
    ]
    start, results = threading.Barrier(16), [None] * 16

    def reserve(i: int) -> None:
        start.wait()
        results[i] = replicas[i % 2].reserve(team, 300)

    threads = [threading.Thread(target=reserve, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    admitted = [r for r in results if isinstance(r, Reservation)]
    assert len(admitted) == 4  # 0, 300, 600 and 900 are under 1000; 1200 is not
    assert all(isinstance(r, int) and r >= 1 for r in results if not isinstance(r, Reservation))
    assert tokens(replicas[0], team, clock.now) == (1200, 0)  # over the quota by less than one reservation

    settles = [threading.Thread(target=r.settle, args=(7,)) for r in admitted for _ in range(3)]  # each three times
    for thread in settles:
        thread.start()
    for thread in settles:
        thread.join(30)
    assert tokens(replicas[1], team, clock.now) == (4 * 7, 0)


def test_a_reservation_is_settled_where_it_was_made_across_a_redis_outage():
    redis, clock, wall = RedisProcess(), Clock(), Clock()
    team = f"t{uuid.uuid4().hex}"
    store = Store(redis.url, clock=clock)
    limits = TeamLimits(store, tokens_per_minute=1000, wall_clock=wall)
    shared = limits.reserve(team, 400)
    assert isinstance(shared, Reservation) and shared.store is store.redis
    redis.stop()
    local = limits.reserve(team, 300)  # Redis gone: reserved in this process's counts
    assert isinstance(local, Reservation) and local.store is store.local and not store.shared
    assert store.local.tokens(team, wall.now) == (300, 0)
    shared.settle(50)  # its 400 stay in Redis (out of reach), its cost is counted here
    assert store.local.tokens(team, wall.now) == (350, 0)
    restarted = RedisProcess(redis.port)  # empty: the outage lost Redis's counts
    try:
        clock.now += RETRY_SECONDS + 1
        assert isinstance(limits.reserve(team, 10), Reservation) and store.shared  # Redis again
        local.settle(20)  # settled where it was made, with Redis back
        assert store.local.tokens(team, wall.now) == (70, 0)
        assert tokens(limits, team, wall.now) == (10, 0)  # Redis's count: only the reservation made there
    finally:
        restarted.stop()


# over HTTP: the real server on its mock backend, teams as the proxy's X-Team-Id (the internal secret off)
QUOTA = 10_000


@pytest.fixture(scope="module")
def limited_server():
    server = ServerProcess(
        "--mock",
        "--mock-tokens-per-second",
        "20",
        "--tokens-per-minute-per-team",
        str(QUOTA),
        "--max-places-per-team",
        "16",
        env={"INTERNAL_SECRET": ""},
    )
    yield server
    server.stop()


def completion(server, team: str | None, n: int, max_tokens: int, stream: bool = True) -> requests.Response:
    return requests.post(
        f"{server.url}/v1/completions",
        headers={"X-Team-Id": team} if team else {},
        json={"model": MODEL_NAME, "prompt": "ab", "n": n, "max_tokens": max_tokens, "stream": stream},
        stream=stream,
        timeout=60,
    )


def test_a_burst_of_n8_requests_gets_429_after_the_first(limited_server):
    team = f"burst-{uuid.uuid4().hex[:8]}"
    start, answers = threading.Barrier(12), [None] * 12

    def send(i: int) -> None:
        start.wait()
        answers[i] = completion(limited_server, team, 8, 1500)  # 12,000 tokens reserved each

    threads = [threading.Thread(target=send, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    admitted = [r for r in answers if r is not None and r.status_code == 200]
    refused = [r for r in answers if r is not None and r.status_code == 429]
    try:
        assert len(admitted) == 1 and len(refused) == 11
        for r in refused:
            assert f"quota of {QUOTA} tokens" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) >= 1
        # the running request's reservation counts until it ends
        assert completion(limited_server, team, 1, 4, stream=False).status_code == 429
        other = completion(limited_server, f"other-{team}", 1, 4, stream=False)
        assert other.status_code == 200 and completion(limited_server, None, 1, 4, stream=False).status_code == 200
    finally:
        for r in admitted:
            r.close()  # a disconnect: settled at what it generated, far under the quota
    assert wait_for(lambda: completion(limited_server, team, 1, 4, stream=False).status_code == 200, 30)


def test_a_teams_places_are_capped_while_another_team_is_served(limited_server):
    team = f"places-{uuid.uuid4().hex[:8]}"
    held = [completion(limited_server, team, 8, 500) for _ in range(2)]  # 16 places, 8,002 tokens reserved
    others = []
    try:
        assert [r.status_code for r in held] == [200, 200]
        over = completion(limited_server, team, 1, 4)  # the 17th place
        assert over.status_code == 429 and over.headers["Retry-After"] == "1"
        message = over.json()["error"]["message"]
        assert f"team '{team}' already holds 16 of this server's rows and queue places" in message
        tgi = requests.post(
            f"{limited_server.url}/generate",
            headers={"X-Team-Id": team},
            json={"inputs": "ab", "parameters": {"max_new_tokens": 4}},
            timeout=60,
        )
        assert tgi.status_code == 429 and "already holds 16" in tgi.json()["error"]  # in each API's shape
        others = [completion(limited_server, f"other-{team}", 8, 500), completion(limited_server, None, 8, 500)]
        assert [r.status_code for r in others] == [200, 200]  # another team, and a request without a team
    finally:
        for r in held + others:
            r.close()
    assert wait_for(lambda: completion(limited_server, team, 1, 4, stream=False).status_code == 200, 30)
