"""The one proxy configuration, built once at the entry point from CLI flags and the environment."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
PUBLIC_KEY_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
MIN_SECRET_BYTES = 32


class ConfigError(ValueError):
    """The flags and environment do not make a usable configuration; the proxy refuses to start."""


@dataclass(frozen=True)
class ProxyConfig:
    jwt_secret: str | None = field(default=None, repr=False)  # HMAC key; required when an HS* algorithm is accepted
    # INTERNAL_SECRET (environment only): added to every upstream request as lifecycle.internal.INTERNAL_HEADER
    internal_secret: str | None = field(default=None, repr=False)
    host: str = "0.0.0.0"
    port: int = 1223
    # inference servers' base URLs; a host name may resolve to several addresses, each one an upstream
    upstreams: tuple[str, ...] = ("http://127.0.0.1:8000",)
    upstream_cooldown: float = 5.0  # seconds an upstream that refused a connection or answered 503 is skipped
    upstream_resolve_interval: float = 10.0  # seconds between DNS look-ups of upstream host names
    threads: int = 128  # upstream connections kept alive in the pool
    max_connections: int = 4096  # client connections held at once (gevent greenlets: idle ones cost a few kB)
    header_timeout: float = 10.0  # seconds a client has to send its request headers (and to idle between requests)
    body_timeout: float = 30.0  # seconds a client has to send its whole request body; then 408
    drain_timeout: float = 90.0  # on SIGTERM/SIGINT: seconds open streams get to finish (above the server's 60)
    jwt_algorithms: tuple[str, ...] = ("HS256",)
    jwt_public_key: str | None = field(default=None, repr=False)  # PEM text, for RS*/PS*/ES*/EdDSA
    jwt_required_claims: tuple[str, ...] = ("team_id", "token_id")
    jwt_require_exp: bool = True  # tokens must end; --no-jwt-require-exp accepts tokens without exp
    jwt_revoked_file: Path | None = None  # token_ids refused from now on, one per line, re-read when it changes
    jwt_leeway: float = 30.0  # seconds of clock skew tolerated on exp, nbf and iat
    jwt_audience: str | None = None  # when set, tokens must carry this aud
    jwt_issuer: str | None = None  # when set, tokens must carry this iss
    connect_timeout: float = 5.0  # seconds to open the upstream connection; then 504
    first_byte_timeout: float = 120.0  # seconds until upstream sends its response headers; then 504
    stream_idle_timeout: float = 600.0  # longest silence between two body chunks once streaming; 0: no limit
    max_concurrent_per_team: int = 16  # open rows per team_id (a request weighs its n); beyond it 429; 0: no limit
    redis_url: str | None = field(default=None, repr=False)  # shared counts for every proxy replica (None: in-process)
    retry_after: int = 1  # the Retry-After seconds sent with a 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413 (the server's own limit: no larger)
    log_level: str = "info"

    @classmethod
    def from_args(cls, argv: Sequence[str], env: Mapping[str, str]) -> ProxyConfig:
        args = build_parser(env).parse_args(list(argv))
        values = {k: v for k, v in vars(args).items() if not k.startswith("_given_")}
        return cls.build(
            secret=env.get("JWT_SECRET") or None, internal_secret=env.get("INTERNAL_SECRET") or None, **values
        )

    @classmethod
    def build(cls, *, secret: str | None, jwt_public_key_file: Path | None = None, **values: Any) -> ProxyConfig:
        """Validate and normalise the parsed values; raise ConfigError when the proxy must not start."""
        algorithms = tuple(dict.fromkeys(a.strip() for a in values.pop("jwt_algorithms", ("HS256",)) if a.strip()))
        if not algorithms:
            raise ConfigError("no JWT algorithm accepted")
        unknown = [a for a in algorithms if a not in HMAC_ALGORITHMS | PUBLIC_KEY_ALGORITHMS]
        if unknown:
            raise ConfigError(
                f"unsupported JWT algorithm(s) {', '.join(unknown)}; choose from "
                f"{', '.join(sorted(HMAC_ALGORITHMS | PUBLIC_KEY_ALGORITHMS))}"
            )
        if any(a in HMAC_ALGORITHMS for a in algorithms):
            if not secret:
                raise ConfigError("JWT_SECRET is required (set it in the environment)")
            if len(secret.encode()) < MIN_SECRET_BYTES:
                raise ConfigError(
                    f"JWT_SECRET is only {len(secret.encode())} bytes long: anyone who guesses it can mint "
                    f"tokens. Use at least {MIN_SECRET_BYTES} random bytes (python3 -c 'import secrets; "
                    f"print(secrets.token_urlsafe(48))')."
                )
        public_key = None
        if any(a in PUBLIC_KEY_ALGORITHMS for a in algorithms):
            if jwt_public_key_file is None:
                raise ConfigError(
                    "--jwt-public-key-file is required for "
                    + ", ".join(a for a in algorithms if a in PUBLIC_KEY_ALGORITHMS)
                )
            try:
                public_key = Path(jwt_public_key_file).read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read the public key file: {exc}") from exc
        upstreams = tuple(dict.fromkeys(_upstream_url(u) for u in values.pop("upstreams", None) or cls.upstreams))
        claims = tuple(dict.fromkeys(c.strip() for c in values.pop("jwt_required_claims", ()) if c.strip()))
        config = cls(
            jwt_secret=secret,
            jwt_algorithms=algorithms,
            jwt_public_key=public_key,
            upstreams=upstreams,
            jwt_required_claims=claims,
            **values,
        )
        for name in (
            "port",
            "threads",
            "connect_timeout",
            "first_byte_timeout",
            "max_body_bytes",
            "max_connections",
            "header_timeout",
            "body_timeout",
            "upstream_resolve_interval",
        ):
            if getattr(config, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        for name in (
            "stream_idle_timeout",
            "max_concurrent_per_team",
            "retry_after",
            "jwt_leeway",
            "drain_timeout",
            "upstream_cooldown",
        ):
            if getattr(config, name) < 0:
                raise ConfigError(f"{name} must not be negative")
        return config


def _upstream_url(value: str) -> str:
    url = value.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"upstream must be an http(s) URL like http://127.0.0.1:8000, not {value!r}")
    return url


def _bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    return value.strip().lower() in ("1", "true", "yes", "on")


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value)


# flag -> (field, environment variable, type, help); the default comes from ProxyConfig
# (flag, field, environment variable, the conversion of a given value, help)
_OPTIONS: list[tuple[str, str, str, Callable[[str], Any], str]] = [
    ("--host", "host", "PROXY_HOST", str, "listen address"),
    ("--port", "port", "PROXY_PORT", int, "listen port"),
    (
        "--upstream",
        "upstreams",
        "UPSTREAM_URL",
        _names,
        "inference server base URL; repeat the flag (or separate by commas) for several servers; a host name that "
        "resolves to several addresses gives one upstream per address",
    ),
    (
        "--upstream-cooldown",
        "upstream_cooldown",
        "UPSTREAM_COOLDOWN",
        float,
        "seconds an upstream that refused a connection or answered 503 is skipped before it is tried again",
    ),
    (
        "--upstream-resolve-interval",
        "upstream_resolve_interval",
        "UPSTREAM_RESOLVE_INTERVAL",
        float,
        "seconds between DNS look-ups of upstream host names",
    ),
    ("--threads", "threads", "PROXY_THREADS", int, "upstream connections kept alive"),
    ("--max-connections", "max_connections", "PROXY_MAX_CONNECTIONS", int, "client connections held at once"),
    (
        "--header-timeout",
        "header_timeout",
        "PROXY_HEADER_TIMEOUT",
        float,
        "seconds a client has to send its request headers",
    ),
    (
        "--body-timeout",
        "body_timeout",
        "PROXY_BODY_TIMEOUT",
        float,
        "seconds a client has to send its request body before 408",
    ),
    (
        "--drain-timeout",
        "drain_timeout",
        "PROXY_DRAIN_TIMEOUT",
        float,
        "seconds open streams get to finish after SIGTERM/SIGINT",
    ),
    ("--jwt-algorithms", "jwt_algorithms", "JWT_ALGORITHMS", _names, "accepted JWT algorithms, comma-separated"),
    (
        "--jwt-public-key-file",
        "jwt_public_key_file",
        "JWT_PUBLIC_KEY_FILE",
        Path,
        "PEM public key for RS*/PS*/ES*/EdDSA tokens",
    ),
    (
        "--jwt-required-claims",
        "jwt_required_claims",
        "JWT_REQUIRED_CLAIMS",
        _names,
        "claims every token must carry, comma-separated",
    ),
    (
        "--jwt-require-exp",
        "jwt_require_exp",
        "JWT_REQUIRE_EXP",
        bool,
        "reject tokens without an exp claim (the default; --no-jwt-require-exp accepts tokens that never end)",
    ),
    (
        "--jwt-revoked-file",
        "jwt_revoked_file",
        "JWT_REVOKED_FILE",
        Path,
        "a file of revoked token_ids, one per line ('#' starts a comment; a JSON string for an id with '#' or outer "
        "spaces), re-read within a second of a change",
    ),
    ("--jwt-leeway", "jwt_leeway", "JWT_LEEWAY_SECONDS", float, "clock skew tolerated on exp/nbf/iat, seconds"),
    ("--jwt-audience", "jwt_audience", "JWT_AUDIENCE", str, "required aud claim"),
    ("--jwt-issuer", "jwt_issuer", "JWT_ISSUER", str, "required iss claim"),
    (
        "--connect-timeout",
        "connect_timeout",
        "UPSTREAM_CONNECT_TIMEOUT",
        float,
        "seconds to connect to upstream before 504",
    ),
    (
        "--first-byte-timeout",
        "first_byte_timeout",
        "UPSTREAM_FIRST_BYTE_TIMEOUT",
        float,
        "seconds for upstream to start answering before 504",
    ),
    (
        "--stream-idle-timeout",
        "stream_idle_timeout",
        "UPSTREAM_STREAM_IDLE_TIMEOUT",
        float,
        "longest pause between streamed chunks before the stream is cut, seconds (0: none)",
    ),
    (
        "--max-concurrent-per-team",
        "max_concurrent_per_team",
        "MAX_CONCURRENT_PER_TEAM",
        int,
        "open rows allowed per team_id before 429, a request weighing the choices it asks for (n, best_of) "
        "(0: no limit)",
    ),
    (
        "--redis-url",
        "redis_url",
        "REDIS_URL",
        str,
        "Redis shared by every proxy replica for the team limits, e.g. redis://redis:6379/0 (none: counted in this "
        "process; while Redis is unreachable each replica counts alone)",
    ),
    ("--retry-after", "retry_after", "RETRY_AFTER_SECONDS", int, "Retry-After seconds sent with a 429"),
    ("--max-body-bytes", "max_body_bytes", "PROXY_MAX_BODY_BYTES", int, "largest accepted request body"),
    ("--log-level", "log_level", "PROXY_LOG_LEVEL", str, "gunicorn log level"),
]


class _Extend(argparse.Action):
    """Each use of the flag adds its (comma-separated) values; the first use drops the default."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, "_given_" + self.dest, False)
        current = tuple(getattr(namespace, self.dest)) if given else ()
        setattr(namespace, self.dest, current + tuple(values or ()))  # values: _names's tuple
        setattr(namespace, "_given_" + self.dest, True)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m proxy",
        description="JWT-checking reverse proxy in front of the inference server. The HMAC secret is read from "
        "the JWT_SECRET environment variable (never a flag, so it stays out of process listings).",
    )
    defaults = ProxyConfig()
    for flag, name, var, kind, help_text in _OPTIONS:
        default = getattr(defaults, name, None)
        raw = env.get(var)
        if kind is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=_bool(raw) if raw else default,
                help=f"{help_text} (env {var})",
            )
            continue
        shown = ",".join(default) if isinstance(default, tuple) else default
        if name == "upstreams":  # repeatable: the flags' URLs together replace the environment's
            parser.add_argument(
                flag,
                dest=name,
                type=kind,
                action=_Extend,
                metavar="URL",
                default=kind(raw) if raw else default,
                help=f"{help_text} (env {var}, comma-separated, default {shown})",
            )
            continue
        parser.add_argument(
            flag,
            dest=name,
            type=kind,
            default=kind(raw) if raw else default,
            help=f"{help_text} (env {var}, default {shown})",
        )
    return parser
