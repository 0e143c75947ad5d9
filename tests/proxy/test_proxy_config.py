"""In-process checks of the proxy's building blocks: configuration, the team limits, header rewriting."""

from __future__ import annotations

import pytest
from proxy_helpers import SECRET, make_token

from lifecycle.quota import Store, TeamLimits
from proxy.auth import AuthError, Identity, TokenVerifier, bearer_token, request_token
from proxy.config import ConfigError, ProxyConfig
from proxy.upstream import client_response_headers, upstream_request_headers


def test_defaults():
    config = ProxyConfig.from_args([], {"JWT_SECRET": SECRET})
    assert config.port == 1223
    assert config.upstreams == ("http://127.0.0.1:8000",)
    assert config.jwt_algorithms == ("HS256",)
    assert config.jwt_required_claims == ("team_id", "token_id")
    assert config.jwt_require_exp is True  # tokens must end unless --no-jwt-require-exp
    assert config.max_concurrent_per_team == 16  # on by default: half the server's rows
    assert config.redis_url is None
    assert SECRET not in repr(config)


def test_flags_win_over_environment():
    env = {
        "JWT_SECRET": SECRET,
        "PROXY_PORT": "2000",
        "UPSTREAM_URL": "http://10.0.0.1:9000/",
        "JWT_REQUIRE_EXP": "1",
        "JWT_REQUIRED_CLAIMS": "team_id",
        "MAX_CONCURRENT_PER_TEAM": "3",
    }
    config = ProxyConfig.from_args([], env)
    assert (
        config.port,
        config.upstreams,
        config.jwt_require_exp,
        config.jwt_required_claims,
        config.max_concurrent_per_team,
    ) == (2000, ("http://10.0.0.1:9000",), True, ("team_id",), 3)
    config = ProxyConfig.from_args(
        ["--port", "3000", "--no-jwt-require-exp", "--jwt-required-claims", "a,b", "--max-concurrent-per-team", "0"],
        env,
    )
    assert (config.port, config.jwt_require_exp, config.jwt_required_claims, config.max_concurrent_per_team) == (
        3000,
        False,
        ("a", "b"),
        0,
    )


def test_upstream_flag_repeats_and_replaces_the_environment():
    env = {"JWT_SECRET": SECRET, "UPSTREAM_URL": "http://a:8000/, http://b:8000"}
    assert ProxyConfig.from_args([], env).upstreams == ("http://a:8000", "http://b:8000")
    config = ProxyConfig.from_args(
        ["--upstream", "http://c:1", "--upstream", "http://d:2,http://[::1]:3", "--upstream", "http://c:1/"], env
    )
    assert config.upstreams == ("http://c:1", "http://d:2", "http://[::1]:3")


@pytest.mark.parametrize(
    "argv, env, fragment",
    [
        ([], {}, "JWT_SECRET is required"),
        ([], {"JWT_SECRET": ""}, "JWT_SECRET is required"),
        (["--jwt-algorithms", "none"], {"JWT_SECRET": SECRET}, "unsupported"),
        (["--jwt-algorithms", "RS256"], {"JWT_SECRET": SECRET}, "public-key-file"),
        (["--upstream", "ftp://x"], {"JWT_SECRET": SECRET}, "upstream"),
        (["--upstream", "http://a:1", "--upstream", "http://b:port"], {"JWT_SECRET": SECRET}, "upstream"),
        (["--upstream-cooldown", "-1"], {"JWT_SECRET": SECRET}, "upstream_cooldown"),
        (["--threads", "0"], {"JWT_SECRET": SECRET}, "threads"),
    ],
)
def test_refuses_bad_configuration(argv, env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ProxyConfig.from_args(argv, env)


def test_a_secret_under_32_bytes_is_refused():
    with pytest.raises(ConfigError, match="at least 32"):
        ProxyConfig.from_args([], {"JWT_SECRET": "x" * 31})
    assert ProxyConfig.from_args([], {"JWT_SECRET": "x" * 32}).jwt_secret == "x" * 32


def test_team_limits_count_in_process_without_redis_and_release_once():
    limiter = TeamLimits(Store(None), max_concurrent=2)
    a1, a2 = limiter.acquire("a"), limiter.acquire("a")
    assert a1 and a2 and limiter.acquire("a") is None
    assert limiter.acquire("b") is not None
    a1.release()
    a1.release()  # idempotent: must not free a second slot
    assert limiter.open_leases() == 2  # a2 and b's
    assert limiter.acquire("a") is not None and limiter.acquire("a") is None
    assert TeamLimits(Store(None), max_concurrent=0).acquire("a") is not None  # off
    assert limiter.store.fallbacks == 0 and not limiter.store.shared


def test_bearer_and_verifier():
    with pytest.raises(AuthError, match="missing"):
        bearer_token(None)
    with pytest.raises(AuthError, match="scheme"):
        bearer_token("Basic abc")
    assert bearer_token("bearer  abc ") == "abc"
    # Anthropic's SDK sends the token in x-api-key; both headers given must agree
    assert (
        request_token(None, " abc ") == request_token("Bearer abc", "abc") == request_token("Bearer abc", None) == "abc"
    )
    with pytest.raises(AuthError, match="different"):
        request_token("Bearer abc", "xyz")
    with pytest.raises(AuthError, match="x-api-key"):
        request_token(None, None)
    verifier = TokenVerifier(ProxyConfig.from_args([], {"JWT_SECRET": SECRET}))
    assert verifier.verify(make_token()) == Identity("team-a", "token-1")
    assert verifier.verify(make_token({"team_id": 7, "token_id": "k"})) == Identity("7", "k")
    with pytest.raises(AuthError, match="team_id"):
        verifier.verify(make_token({"team_id": "a\r\nX-Evil: 1", "token_id": "k"}))


def test_request_headers_rewritten():
    client = [
        ("Host", "proxy.example:1223"),
        ("Authorization", "Bearer t"),
        ("Connection", "keep-alive, X-Hop"),
        ("X-Hop", "1"),
        ("Keep-Alive", "5"),
        ("TE", "trailers"),
        ("Proxy-Authorization", "x"),
        ("X-Team-Id", "evil"),
        ("x-token-id", "evil"),
        ("X-Forwarded-For", "10.0.0.1"),
        ("Content-Length", "3"),
        ("Accept", "*/*"),
    ]
    headers = upstream_request_headers(
        client,
        upstream_host="127.0.0.1:8000",
        client_addr="127.0.0.2",
        scheme="http",
        request_id="r1",
        identity=Identity("t", "k"),
    )
    assert headers == {
        "Accept": "*/*",
        "X-Forwarded-For": "127.0.0.2",
        "X-Forwarded-Proto": "http",
        "X-Forwarded-Host": "proxy.example:1223",
        "X-Request-Id": "r1",
        "Host": "127.0.0.1:8000",
        "X-Team-Id": "t",
        "X-Token-Id": "k",
    }
    assert upstream_request_headers(
        [], upstream_host="h", client_addr="c", scheme="https", request_id="r", identity=None
    ) == {"X-Forwarded-For": "c", "X-Forwarded-Proto": "https", "X-Request-Id": "r", "Host": "h"}


def test_response_headers_filtered():
    upstream = [
        ("Content-Type", "text/plain"),
        ("Transfer-Encoding", "chunked"),
        ("Connection", "keep-alive, X-A"),
        ("X-A", "1"),
        ("Date", "x"),
        ("Server", "y"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]
    assert client_response_headers(upstream) == [
        ("Content-Type", "text/plain"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]
