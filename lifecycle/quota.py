"""Per-team limits shared by every replica: concurrent requests (counted by the proxy) and generated tokens per
minute (counted by the server, which knows each request's tokens), in Redis when a URL is given, else in this
process.

Concurrency is a set of leases per team (a Redis sorted set scored by expiry): a request takes one on admission,
weighing what it costs (one place per row it asks for: ``n``), and gives it back when its answer ends; the holder
refreshes its leases every ``LEASE_SECONDS / 4``, so a replica that dies without giving its leases back frees them
within ``LEASE_SECONDS``. Tokens are counted in
one-minute buckets per team; a team's rate is the current bucket plus the previous one weighted by the part of
it still inside the last 60 seconds (a sliding window). A request reserves its most possible cost on admission,
atomically refused while the team's rate is already at or over the quota (so a burst overshoots it by at most one
request's reservation), and settles when its answer ends: the reservation is given back to the minute it was added
to and the request's actual cost is counted in the current one.

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
from dataclasses import dataclass, field

log = logging.getLogger("quota")

LEASE_SECONDS = 60.0  # a lease not refreshed for this long is dropped (its replica died)
RETRY_SECONDS = 5.0  # after a Redis error, how long this process counts alone before trying Redis again
REDIS_TIMEOUT = 0.25  # seconds a Redis command may take before the store falls back for this request
WINDOW = 60  # seconds of the token rate's window
# a prompt token's cost in the quota, in generated tokens: prefill computes a whole chunk of prompt tokens in one
# forward, where decoding takes a step per generated token
PROMPT_TOKEN_WEIGHT = 0.25


def lease_members(lease: str, weight: int) -> list[str]:
    """A lease's places in its team's set, one per row it weighs: counting the members is counting the rows, so a
    weighted lease and a replica's unweighted one (an older version, during an upgrade) count alike."""
    return [f"{lease}:{i}" for i in range(max(1, weight))]


def _minute(now: float) -> int:
    return int(now // WINDOW)


def previous_share(now: float) -> float:
    """The part of the previous minute's bucket still inside the last 60 seconds."""
    return (WINDOW - (now - _minute(now) * WINDOW)) / WINDOW


def window_rate(current: float, previous: float, now: float) -> float:
    """Tokens in the last 60 seconds, estimated from this minute's bucket and the previous one's share."""
    return current + previous * previous_share(now)


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
        self._leases: dict[str, dict[str, float]] = {}  # team -> lease member (lease_members) -> expiry
        self._tokens: dict[str, dict[int, int]] = {}  # team -> minute -> tokens
        self._reserved: dict[str, int] = {}  # reservations taken here and not yet settled: id -> minute

    def acquire(self, team: str, lease: str, limit: int, now: float, weight: int = 1) -> bool:
        with self._lock:
            held = {k: v for k, v in self._leases.get(team, {}).items() if v > now}
            members = lease_members(lease, weight)
            if len(held) + len(members) > limit:
                self._leases[team] = held
                return False
            held.update(dict.fromkeys(members, now + LEASE_SECONDS))
            self._leases[team] = held
            return True

    def release(self, team: str, lease: str, weight: int = 1) -> None:
        with self._lock:
            held = self._leases.get(team, {})
            for member in lease_members(lease, weight):
                held.pop(member, None)
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

    def reserve(self, team: str, reservation: str, count: int, quota: int, now: float) -> tuple[int, int] | None:
        """Add count to this minute's bucket unless the team's rate is already at or over quota, atomically: None
        when added, else the (current, previous) buckets that refused it."""
        minute = _minute(now)
        with self._lock:
            buckets = self._tokens.setdefault(team, {})
            current, previous = buckets.get(minute, 0), buckets.get(minute - 1, 0)
            if window_rate(current, previous, now) >= quota:
                return current, previous
            buckets[minute] = current + count
            for old in [m for m in buckets if m < minute - 1]:
                del buckets[old]
            for old_id in [r for r, m in self._reserved.items() if m < minute - 1]:  # outside the window: nothing
                del self._reserved[old_id]  # left to give back (their settle only counts the actual cost)
            self._reserved[reservation] = minute
            return None

    def settle(self, team: str, reservation: str, minute: int, reserved: int, actual: int, now: float) -> None:
        """Give a reservation taken here back to its minute's bucket and count the actual cost in this minute's. A
        reservation this process does not hold (taken in Redis before an outage) gives nothing back here."""
        current = _minute(now)
        with self._lock:
            buckets = self._tokens.setdefault(team, {})
            if self._reserved.pop(reservation, None) == minute and minute in buckets:
                buckets[minute] = max(0, buckets[minute] - reserved)
            if actual > 0:
                buckets[current] = buckets.get(current, 0) + actual
            for old in [m for m in buckets if m < current - 1]:
                del buckets[old]


# take a lease if the team's places held (expired ones dropped first) plus the lease's own stay within the limit,
# atomically. ARGV: now, the lease's expiry, the limit, the set's ttl, then the lease's members (lease_members)
_ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) + #ARGV - 4 > tonumber(ARGV[3]) then return 0 end
for i = 5, #ARGV do redis.call('ZADD', KEYS[1], ARGV[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""


# KEYS: this minute's and the previous minute's token buckets; ARGV: count, the previous bucket's weight in the
# window, quota, the buckets' ttl. Add count to this minute unless the window's rate is already at or over quota,
# atomically: {} when added, else {current, previous}
_RESERVE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local previous = tonumber(redis.call('GET', KEYS[2]) or '0')
if current + previous * tonumber(ARGV[2]) >= tonumber(ARGV[3]) then return {current, previous} end
redis.call('INCRBY', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {}
"""

# KEYS: the reservation's bucket, this minute's; ARGV: the tokens to give back, the actual cost, the buckets' ttl.
# A bucket never goes below zero (a Redis that restarted has lost the reservation)
_SETTLE = """
if tonumber(ARGV[1]) > 0 then
  if redis.call('DECRBY', KEYS[1], ARGV[1]) < 0 then redis.call('SET', KEYS[1], 0) end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if tonumber(ARGV[2]) > 0 then
  redis.call('INCRBY', KEYS[2], ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
return 1
"""


class RedisStore:
    """The same counts in Redis, shared by every replica pointed at it."""

    def __init__(self, url: str, prefix: str = "inference:quota:"):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT)
        self.prefix = prefix
        self._acquire = self.client.register_script(_ACQUIRE)
        self._reserve = self.client.register_script(_RESERVE)
        self._settle = self.client.register_script(_SETTLE)

    def _leases(self, team: str) -> str:
        return f"{self.prefix}leases:{team}"

    def _bucket(self, team: str, minute: int) -> str:
        return f"{self.prefix}tokens:{team}:{minute}"

    def acquire(self, team: str, lease: str, limit: int, now: float, weight: int = 1) -> bool:
        ttl = math.ceil(LEASE_SECONDS) * 2
        args: list[str | float] = [now, now + LEASE_SECONDS, limit, ttl, *lease_members(lease, weight)]
        return bool(self._acquire(keys=[self._leases(team)], args=args))

    def release(self, team: str, lease: str, weight: int = 1) -> None:
        self.client.zrem(self._leases(team), *lease_members(lease, weight))

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

    def reserve(self, team: str, reservation: str, count: int, quota: int, now: float) -> tuple[int, int] | None:
        minute = _minute(now)
        refused = self._reserve(
            keys=[self._bucket(team, minute), self._bucket(team, minute - 1)],
            args=[count, previous_share(now), quota, 3 * WINDOW],
        )
        return (int(refused[0]), int(refused[1])) if refused else None

    def settle(self, team: str, reservation: str, minute: int, reserved: int, actual: int, now: float) -> None:
        current = _minute(now)
        refund = reserved if minute >= current - 1 else 0  # an older bucket is outside the window: nothing to fix
        self._settle(keys=[self._bucket(team, minute), self._bucket(team, current)], args=[refund, actual, 3 * WINDOW])


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
    """One admitted request's places in its team's count (``weight``: the rows it asks for); release() is idempotent,
    so every exit path may call it."""

    limits: TeamLimits | None
    team: str | None
    id: str = ""
    store: MemoryStore | RedisStore | None = None
    released: bool = False
    weight: int = 1

    def release(self) -> None:
        if self.limits is not None and not self.released:
            self.released = True
            self.limits._release(self)


@dataclass
class Reservation:
    """One admitted request's most possible cost, held against its team's quota until its answer ends; settle() gives
    it back and counts what the request actually cost, once (idempotent, so every exit path may call it)."""

    limits: TeamLimits | None
    team: str | None
    id: str = ""
    tokens: int = 0  # reserved
    minute: int = 0  # the wall-clock minute whose bucket holds them
    store: MemoryStore | RedisStore | None = None  # where they were reserved
    settled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def settle(self, actual: int) -> None:
        """Give the reservation back to its minute and count ``actual`` tokens (see TeamLimits.cost) in this one."""
        if self.limits is None:
            return
        with self._lock:
            if self.settled:
                return
            self.settled = True
        self.limits._settle(self, actual)


class TeamLimits:
    """Both limits of every team over one Store; 0 turns a limit off."""

    def __init__(
        self,
        store: Store,
        max_concurrent: int = 0,
        tokens_per_minute: int = 0,
        wall_clock: Callable[[], float] = time.time,
        prompt_token_weight: float = PROMPT_TOKEN_WEIGHT,
    ):
        self.store = store
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        if prompt_token_weight < 0:
            raise ValueError(f"prompt_token_weight must be 0 or more, not {prompt_token_weight}")
        self.prompt_token_weight = prompt_token_weight  # a prompt token's share of a generated token's cost
        self._now = wall_clock  # the buckets are wall-clock minutes, the same on every replica
        self._lock = threading.Lock()
        self._open: dict[str, Lease] = {}  # this process's leases, refreshed while their requests run
        self._refresher: threading.Thread | None = None

    # concurrency (the proxy)
    def acquire(self, team: str | None, weight: int = 1) -> Lease | None:
        """A lease for one more open request of the team weighing ``weight`` places (the rows it asks for: its
        ``n``), or None when the places the team holds plus these would pass max_concurrent (so a weight over
        max_concurrent never passes: the caller tells that apart, see ``never_fits``)."""
        if self.max_concurrent <= 0 or team is None:
            return Lease(None, team)
        lease = Lease(self, team, uuid.uuid4().hex, weight=max(1, weight))
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
        taken = store.call("acquire", lease.team, lease.id, self.max_concurrent, self._now(), lease.weight)
        lease.store = store.redis if store.shared else store.local  # where to give it back
        return taken

    def never_fits(self, team: str | None, weight: int) -> bool:
        """Whether a request of this weight is refused even when its team holds nothing (a 400, not a 429: waiting
        cannot help)."""
        return self.max_concurrent > 0 and team is not None and weight > self.max_concurrent

    def _release(self, lease: Lease) -> None:
        with self._lock:
            self._open.pop(lease.id, None)
        if lease.team is None:  # never counted: acquire gives a lease without a team no limits
            return
        if lease.store is self.store.local:
            self.store.local.release(lease.team, lease.id, lease.weight)
        else:
            self.store.call("release", lease.team, lease.id, lease.weight)

    def open_leases(self) -> int:
        with self._lock:
            return len(self._open)

    def refresh(self) -> None:
        """Extend the leases of this process's open requests (Redis drops those of a replica that died)."""
        with self._lock:
            leases = {m: lease.team for lease in self._open.values() for m in lease_members(lease.id, lease.weight)}
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

    def cost(self, generated: int, prompt_tokens: int) -> int:
        """What a request costs in the quota: its generated tokens (all choices) plus its prompt's at their weight."""
        return generated + math.ceil(prompt_tokens * self.prompt_token_weight)

    def reserve(self, team: str | None, tokens: int) -> Reservation | int:
        """Hold a request's most possible cost (``cost(n * max_tokens, prompt tokens)``) against its team, refused
        atomically while the team's rate is already at or over the quota: the Reservation to settle when the answer
        ends, or the seconds until the rate is under the quota. Without a quota or a team: a Reservation that
        counts nothing."""
        if self.tokens_per_minute <= 0 or team is None:
            return Reservation(None, team)
        store, now = self.store, self._now()
        reservation = Reservation(self, team, uuid.uuid4().hex, max(0, tokens), _minute(now))
        refused = store.call("reserve", team, reservation.id, reservation.tokens, self.tokens_per_minute, now)
        if refused is not None:
            current, previous = refused
            return retry_after(current, previous, now, self.tokens_per_minute)
        reservation.store = store.redis if store.shared else store.local  # where to settle it
        return reservation

    def _settle(self, reservation: Reservation, actual: int) -> None:
        if reservation.team is None:  # never counted: reserve gives a reservation without a team no limits
            return
        args = (reservation.team, reservation.id, reservation.minute, reservation.tokens, max(0, actual), self._now())
        if reservation.store is self.store.local:  # reserved while Redis was away: settled here too
            self.store.local.settle(*args)
        else:  # in Redis; while it is away the reservation stays there (its minute leaves the window), the cost here
            self.store.call("settle", *args)
