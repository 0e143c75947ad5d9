"""UpstreamPool in-process: least-open choice, cooldowns, DNS names with several addresses (fake clock, resolver)."""

from __future__ import annotations

import socket

from proxy.upstream import UpstreamPool


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Resolver:
    """getaddrinfo stand-in: host -> addresses, changeable between look-ups; counts look-ups."""

    def __init__(self, table: dict[str, list[str]]):
        self.table = table
        self.calls = 0

    def __call__(self, host, port, type=0):
        self.calls += 1
        if host not in self.table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, type, 6, "", (a, port)) for a in self.table[host]]


def pool(urls, clock=None, resolver=None, cooldown=5.0, resolve_interval=10.0) -> UpstreamPool:
    return UpstreamPool(
        urls,
        cooldown=cooldown,
        resolve_interval=resolve_interval,
        resolver=resolver or Resolver({}),
        clock=clock or Clock(),
    )


def test_each_pick_goes_to_the_upstream_with_fewest_open_requests():
    p = pool(["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"])
    a, b, c = p.backends()
    first = [p.pick(set()) for _ in range(3)]
    assert sorted(x.url for x in first) == [a.url, b.url, c.url]  # one each
    p.release(b)
    assert p.pick(set()) is b  # b has the fewest now, whoever's turn it would be
    p.release(a)
    p.release(c)
    assert (a.open, b.open, c.open) == (0, 1, 0)
    assert {p.pick(set()).url, p.pick(set()).url} == {a.url, c.url}


def test_ties_are_taken_in_turn():
    p = pool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    seen = []
    for _ in range(4):
        backend = p.pick(set())
        seen.append(backend.url)
        p.release(backend)
    assert seen[0] != seen[1] and seen[:2] == seen[2:]


def test_tried_upstreams_are_not_picked_again_and_none_means_all_tried():
    p = pool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    tried = set()
    for _ in range(2):
        tried.add(p.pick(tried))
    assert p.pick(tried) is None


def test_a_failed_upstream_is_skipped_for_the_cooldown_then_tried_again():
    clock = Clock()
    p = pool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], clock=clock, cooldown=5)
    a, b = p.backends()
    p.failed(a, "connection refused")
    for _ in range(3):
        picked = p.pick(set())
        assert picked is b
        p.release(picked)
    assert p.pick({b}) is a  # every other upstream tried: the cooling one is still tried, never a refusal
    p.release(a)
    clock.now += 5.1
    assert {p.pick(set()).url, p.pick(set()).url} == {a.url, b.url}


def test_the_cooldown_doubles_per_failure_honours_retry_after_and_resets_on_success():
    clock = Clock()
    p = pool(["http://10.0.0.1:8000"], clock=clock, cooldown=2)
    (a,) = p.backends()
    for _ in range(3):  # requests open on it when it went down fail together: one failure
        p.failed(a, "refused")
    assert (a.failures, a.down_until) == (1, clock.now + 2)
    clock.now += 2
    p.failed(a, "refused")  # tried again after the cooldown, still down: twice as long
    assert a.down_until == clock.now + 4
    clock.now += 4
    p.failed(a, "answered 503", retry_after=30)
    assert a.down_until == clock.now + 30
    for _ in range(10):
        clock.now = a.down_until
        p.failed(a, "refused")
    assert a.down_until == clock.now + 32  # the doubling stops at 16 times the cooldown
    p.failed(a, "answered 503", retry_after=3600)
    assert a.down_until == clock.now + 60  # however long the Retry-After
    p.succeeded(a)
    assert (a.failures, a.down_until) == (0, 0.0)


def test_a_host_name_gives_one_upstream_per_address_and_follows_the_dns():
    clock = Clock()
    dns = Resolver({"inference": ["10.1.0.1", "10.1.0.2"]})
    p = pool(["http://inference:8000/api"], clock=clock, resolver=dns, resolve_interval=10)
    assert [(b.url, b.host) for b in p.backends()] == [
        ("http://10.1.0.1:8000/api", "inference:8000"),
        ("http://10.1.0.2:8000/api", "inference:8000"),
    ]
    kept = p.pick(set())
    dns.table["inference"] = [kept.url.split("//")[1].split(":")[0], "10.1.0.3"]
    clock.now += 5
    p.pick(set())
    assert len(p.backends()) == 2 and dns.calls == 1  # not due yet
    clock.now += 6
    p.pick(set())
    assert dns.calls == 2
    assert sorted(b.url for b in p.backends())[-1] == "http://10.1.0.3:8000/api"
    assert kept in p.backends() and kept.open == 1  # the same server keeps its open count across look-ups


def test_a_failed_look_up_keeps_the_known_addresses_and_is_retried_soon():
    clock = Clock()
    dns = Resolver({})
    p = pool(["http://inference:8000"], clock=clock, resolver=dns)
    assert p.backends() == [] and p.pick(set()) is None  # nothing resolved yet: the proxy answers 502
    dns.table["inference"] = ["10.1.0.1"]
    clock.now += 1.1
    assert p.pick(set()).url == "http://10.1.0.1:8000"
    del dns.table["inference"]
    clock.now += 11
    assert [b.url for b in p.backends()] == ["http://10.1.0.1:8000"]


def test_dual_stack_names_count_each_server_once_and_literals_are_never_looked_up():
    dns = Resolver({"localhost": ["127.0.0.1", "::1"], "v6only": ["fd00::1"]})
    p = pool(
        ["http://localhost:8000", "http://v6only:8000", "http://[fd00::2]:8000", "https://tls-name:443"], resolver=dns
    )
    assert [b.url for b in p.backends()] == [
        "http://127.0.0.1:8000",
        "http://[fd00::1]:8000",
        "http://[fd00::2]:8000",
        "https://tls-name:443",
    ]
    assert dns.calls == 2
