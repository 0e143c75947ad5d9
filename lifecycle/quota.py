"""Per-team limits shared by every replica: concurrent requests (counted by the proxy) and generated tokens per
minute (counted by the server, which knows each request's tokens), in Redis when a URL is given, else in this
process.

Concurrency is a set of leases per team (a Redis sorted set scored by expiry): a request takes one on admission
and gives it back when its answer ends; the holder refreshes its leases every ``LEASE_SECONDS / 4``, so a
replica that dies without giving its leases back frees them within ``LEASE_SECONDS``. Tokens are counted in
one-minute buckets per team; a team's rate is the current bucket plus the previous one weighted by the part of
it still inside the last 60 seconds (a sliding window), and a request is refused while that reaches the quota.

A Redis outage never stops the service: the store falls back to this process's own counts (each replica then
limits on its own, as without Redis), logs one warning when Redis fails and one line when it answers again,
counts the fallbacks (``Store.fallbacks``), and tries Redis again after ``RETRY_SECONDS``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("quota")

LEASE_SECONDS = 60.0  # a lease not refreshed for this long is dropped (its replica died)
RETRY_SECONDS = 5.0  # after a Redis error, how long this process counts alone before trying Redis again
REDIS_TIMEOUT = 0.25  # seconds a Redis command may take before the store falls back for this request
WINDOW = 60  # seconds of the token rate's window


def _minute(now: float) -> int:
    return int(now // WINDOW)


def window_rate(current: float, previous: float, now: float) -> float:
    """Tokens in the last 60 seconds, estimated from this minute's bucket and the previous one's share."""
    elapsed = now - _minute(now) * WINDOW
    return current + previous * (WINDOW - elapsed) / WINDOW


def retry_after(current: float, previous: float, now: float, quota: int) -> int:
    """Seconds until the window's rate falls under quota, if nothing more is generated (at least 1)."""
    elapsed = now - _minute(now) * WINDOW
    if current < quota:  # the previous bucket's share shrinks until the sum is under the quota
        wait = (WINDOW - elapsed) - WINDOW * (quota - current) / previous if previous else 0.0
    else:  # this minute alone is over: wait for it to become the previous bucket, then for its share to shrink
        wait = (WINDOW - elapsed) + WINDOW * (1 - quota / current)
    return max(1, math.floor(wait) + 1)  # strictly past the moment the rate equals the quota


class MemoryStore:
    """Counts in this process (one replica, or the fallback while Redis is away)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._leases: dict[str, dict[str, float]] = {}  # team -> lease id -> expiry
        self._tokens: dict[str, dict[int, int]] = {}  # team -> minute -> tokens

    def acquire(self, team: str, lease: str, limit: int, now: float) -> bool:
        with self._lock:
            held = {k: v for k, v in self._leases.get(team, {}).items() if v > now}
            if len(held) >= limit:
                self._leases[team] = held
                return False
            held[lease] = now + LEASE_SECONDS
            self._leases[team] = held
            return True

    def release(self, team: str, lease: str) -> None:
        with self._lock:
            held = self._leases.get(team, {})
            held.pop(lease, None)
            if not held:
                self._leases.pop(team, None)

    def refresh(self, leases: dict[str, str], now: float) -> None:
        with self._lock:
            for lease, team in leases.items():
                held = self._leases.get(team)
                if held is not None and lease in held:
                    held[lease] = now + LEASE_SECONDS

    def add_tokens(self, team: str, count: int, now: float) -> None:
        minute = _minute(now)
        with self._lock:
            buckets = self._tokens.setdefault(team, {})
            buckets[minute] = buckets.get(minute, 0) + count
            for old in [m for m in buckets if m < minute - 1]:
                del buckets[old]

    def tokens(self, team: str, now: float) -> tuple[int, int]:
        minute = _minute(now)
        with self._lock:
            buckets = self._tokens.get(team, {})
            return buckets.get(minute, 0), buckets.get(minute - 1, 0)


# take a lease if the team holds fewer than the limit (expired ones dropped first), atomically
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class RedisStore:
    """The same counts in Redis, shared by every replica pointed at it."""

    def __init__(self, url: str, prefix: str = "inference:quota:"):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT)
        self.prefix = prefix
        self._acquire = self.client.register_script(_ACQUIRE)

    def _leases(self, team: str) -> str:
        return f"{self.prefix}leases:{team}"

    def _bucket(self, team: str, minute: int) -> str:
        return f"{self.prefix}tokens:{team}:{minute}"

    def acquire(self, team: str, lease: str, limit: int, now: float) -> bool:
        ttl = math.ceil(LEASE_SECONDS) * 2
        return bool(self._acquire(keys=[self._leases(team)], args=[now, now + LEASE_SECONDS, limit, lease, ttl]))

    def release(self, team: str, lease: str) -> None:
        self.client.zrem(self._leases(team), lease)

    def refresh(self, leases: dict[str, str], now: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        for lease, team in leases.items():
            pipe.zadd(self._leases(team), {lease: now + LEASE_SECONDS}, xx=True)
        pipe.execute()

    def add_tokens(self, team: str, count: int, now: float) -> None:
        key = self._bucket(team, _minute(now))
        pipe = self.client.pipeline(transaction=False)
        pipe.incrby(key, count)
        pipe.expire(key, 3 * WINDOW)
        pipe.execute()

    def tokens(self, team: str, now: float) -> tuple[int, int]:
        minute = _minute(now)
        current, previous = self.client.mget(self._bucket(team, minute), self._bucket(team, minute - 1))
        return int(current or 0), int(previous or 0)


class Store:
    """Redis when given and reachable, else this process's counts (see the module's note on outages)."""

    def __init__(self, redis_url: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.local = MemoryStore()
        self.redis = RedisStore(redis_url) if redis_url else None
        self.fallbacks = 0  # operations answered from this process's counts because Redis failed
        self._clock = clock
        self._down_until: float | None = None  # while Redis is taken as down: when to try it again

    @property
    def shared(self) -> bool:
        """Whether the counts are Redis's right now."""
        return self.redis is not None and self._down_until is None

    def call(self, name: str, *args):
        """The operation on Redis, or on this process's counts when there is none or it is failing."""
        if self.redis is not None:
            if self._down_until is None or self._clock() >= self._down_until:
                from redis.exceptions import RedisError

                try:
                    result = getattr(self.redis, name)(*args)
                except RedisError as exc:
                    if self._down_until is None:
                        log.warning(
                            "Redis unreachable (%s): each replica counts the team limits alone until it answers again",
                            exc,
                        )
                    self._down_until = self._clock() + RETRY_SECONDS
                else:
                    if self._down_until is not None:
                        log.warning("Redis answers again: the team limits are shared again")
                        self._down_until = None
                    return result
            self.fallbacks += 1
        return getattr(self.local, name)(*args)


@dataclass
class Lease:
    """One admitted request's place in its team's count; release() is idempotent, so every exit path may call it."""

    limits: TeamLimits | None
    team: str | None
    id: str = ""
    store: MemoryStore | RedisStore | None = None
    released: bool = False

    def release(self) -> None:
        if self.limits is not None and not self.released:
            self.released = True
            self.limits._release(self)


class TeamLimits:
    """Both limits of every team over one Store; 0 turns a limit off."""

    def __init__(
        self,
        store: Store,
        max_concurrent: int = 0,
        tokens_per_minute: int = 0,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self._now = wall_clock  # the buckets are wall-clock minutes, the same on every replica
        self._lock = threading.Lock()
        self._open: dict[str, Lease] = {}  # this process's leases, refreshed while their requests run
        self._refresher: threading.Thread | None = None

    # concurrency (the proxy)
    def acquire(self, team: str | None) -> Lease | None:
        """A lease for one more open request of the team, or None when it already has max_concurrent."""
        if self.max_concurrent <= 0 or team is None:
            return Lease(None, team)
        lease = Lease(self, team, uuid.uuid4().hex)
        if not self._acquire(lease):
            return None
        with self._lock:
            self._open[lease.id] = lease
            if self._refresher is None and self.store.redis is not None:
                self._refresher = threading.Thread(target=self._refresh_forever, name="lease-refresh", daemon=True)
                self._refresher.start()
        return lease

    def _acquire(self, lease: Lease) -> bool:
        store = self.store
        taken = store.call("acquire", lease.team, lease.id, self.max_concurrent, self._now())
        lease.store = store.redis if store.shared else store.local  # where to give it back
        return taken

    def _release(self, lease: Lease) -> None:
        with self._lock:
            self._open.pop(lease.id, None)
        if lease.team is None:  # never counted: acquire gives a lease without a team no limits
            return
        if lease.store is self.store.local:
            self.store.local.release(lease.team, lease.id)
        else:
            self.store.call("release", lease.team, lease.id)

    def open_leases(self) -> int:
        with self._lock:
            return len(self._open)

    def refresh(self) -> None:
        """Extend the leases of this process's open requests (Redis drops those of a replica that died)."""
        with self._lock:
            leases = {lease.id: lease.team for lease in self._open.values()}
        if leases:
            self.store.call("refresh", leases, self._now())

    def _refresh_forever(self) -> None:
        while True:
            time.sleep(LEASE_SECONDS / 4)
            try:
                self.refresh()
            except Exception:  # never let the refresher die: the next round tries again
                log.exception("refreshing the team leases failed")

    # generated tokens (the server)
    def check_tokens(self, team: str | None) -> int | None:
        """None when the team may start a request; else the seconds until its rate is under the quota."""
        if self.tokens_per_minute <= 0 or team is None:
            return None
        now = self._now()
        current, previous = self.store.call("tokens", team, now)
        if window_rate(current, previous, now) < self.tokens_per_minute:
            return None
        return retry_after(current, previous, now, self.tokens_per_minute)

    def charge(self, team: str | None, count: int) -> None:
        """Count a request's generated tokens against its team."""
        if self.tokens_per_minute > 0 and team is not None and count > 0:
            self.store.call("add_tokens", team, count, self._now())
