"""Bearer-token checks. Every rejection is an AuthError whose message names the reason (never the token)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt

from .config import HMAC_ALGORITHMS, ProxyConfig

if TYPE_CHECKING:
    from jwt.types import Options

# claims passed upstream in headers; their values must be safe as header values
IDENTITY_CLAIMS = ("team_id", "token_id")
MAX_CLAIM_CHARS = 256
ADMIN_CLAIM = "admin"  # true: an operator's token, which may read /metrics and /health's details

log = logging.getLogger("proxy")


class AuthError(Exception):
    """401: the request carries no acceptable token."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Identity:
    team_id: str | None
    token_id: str | None
    admin: bool = False  # the token's admin claim is JSON true (anything else: a team's token, never an operator's)


def request_token(authorization: str | None, api_key: str | None) -> str:
    """The token a request carries: ``Authorization: Bearer <token>``, or Anthropic's ``x-api-key: <token>`` (what
    its SDK sends), checked alike; both given must agree."""
    if api_key is not None and api_key.strip():
        if authorization and authorization.strip() and bearer_token(authorization) != api_key.strip():
            raise AuthError("Authorization and x-api-key carry different tokens")
        return api_key.strip()
    return bearer_token(authorization)


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not authorization or not authorization.strip():
        raise AuthError("missing Authorization header (expected 'Bearer <token>', or x-api-key: <token>)")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError(f"unsupported Authorization scheme {scheme[:20]!r} (expected 'Bearer <token>')")
    token = token.strip()
    if not token:
        raise AuthError("empty bearer token")
    return token


def revoked_id(line: str) -> str | None:
    """The token_id a revocation file's line names, matched exactly: a JSON string (a line starting with '"', for
    an id with '#' or outer spaces, e.g. ``"a#b"``), else the line up to a '#' with its outer spaces dropped. None
    for a blank or comment line."""
    text = line.strip()
    if text.startswith('"'):
        try:
            value, end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            value, end = None, 0
        rest = text[end:].strip()
        if isinstance(value, str) and (not rest or rest.startswith("#")):
            return value or None
        log.warning("revocation file: a line starting with '\"' is not a JSON string; read as a plain line")
    return line.split("#", 1)[0].strip() or None


def revocation_line(token_id: str) -> str:
    """The line that revokes exactly this token_id: plain where the plain reading gives it back, else JSON."""
    return token_id if revoked_id(token_id) == token_id and not token_id.startswith('"') else json.dumps(token_id)


class RevokedTokens:
    """The token_ids of a revocation file (one per line, '#' starts a comment, a JSON string for an id a plain line
    cannot hold: see revoked_id), re-read when the file's size or time changes, checked at most once a second: an
    operator revokes a token by adding its token_id, no restart. A file that cannot be read keeps the last list it
    gave (and a missing file at start is an empty list)."""

    CHECK_SECONDS = 1.0

    def __init__(self, path: Path | None):
        self._path = path
        self._ids: frozenset[str] = frozenset()
        self._version: tuple[int, int] | None = None  # the file's size and time when it was read
        self._checked = -1.0

    def __contains__(self, token_id: str | None) -> bool:
        if self._path is None or token_id is None:
            return False
        now = time.monotonic()
        if now - self._checked >= self.CHECK_SECONDS:
            self._checked = now
            try:
                st = os.stat(self._path)
                if (st.st_size, st.st_mtime_ns) != self._version:
                    lines = Path(self._path).read_text(encoding="utf-8").splitlines()
                    self._ids = frozenset(x for x in map(revoked_id, lines) if x is not None)
                    self._version = (st.st_size, st.st_mtime_ns)
            except OSError:
                pass
        return token_id in self._ids


class TokenVerifier:
    def __init__(self, config: ProxyConfig):
        self._config = config
        self._revoked = RevokedTokens(config.jwt_revoked_file)

    def verify(self, token: str) -> Identity:
        c = self._config
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthError("malformed token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none":
            raise AuthError("unsigned token (alg 'none') rejected")
        if alg not in c.jwt_algorithms:
            raise AuthError(f"token algorithm {alg[:20]!r} is not accepted (accepted: {', '.join(c.jwt_algorithms)})")
        # The key follows the algorithm family, so a public key can never be used as an HMAC secret.
        key = c.jwt_secret if alg in HMAC_ALGORITHMS else c.jwt_public_key
        if key is None:  # (ProxyConfig.build requires the key of every accepted algorithm)
            raise AuthError(f"no key for token algorithm {alg!r}")
        required = list(c.jwt_required_claims) + (["exp"] if c.jwt_require_exp else [])
        options: Options = {
            "require": required,
            "verify_aud": c.jwt_audience is not None,
            "verify_iss": c.jwt_issuer is not None,
        }
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                options=options,
                leeway=c.jwt_leeway,
                audience=c.jwt_audience,
                issuer=c.jwt_issuer,
            )
        except jwt.ExpiredSignatureError:
            raise AuthError("token expired") from None
        except jwt.ImmatureSignatureError as exc:
            which = "iat" if "(iat)" in str(exc) else "nbf"
            raise AuthError(f"token not yet valid ({which} is in the future)") from None
        except jwt.InvalidSignatureError:
            raise AuthError("bad token signature") from None
        except jwt.MissingRequiredClaimError as exc:
            raise AuthError(f"token is missing the required claim {exc.claim!r}") from None
        except jwt.InvalidAudienceError:
            raise AuthError("token audience (aud) not accepted") from None
        except jwt.InvalidIssuerError:
            raise AuthError("token issuer (iss) not accepted") from None
        except jwt.DecodeError:
            raise AuthError("malformed token") from None
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {exc}") from None
        if not isinstance(claims, dict):
            raise AuthError("malformed token")
        identity = Identity(
            **{name: _identity_claim(claims, name) for name in IDENTITY_CLAIMS}, admin=claims.get(ADMIN_CLAIM) is True
        )
        if identity.token_id in self._revoked:
            raise AuthError("token revoked")
        return identity


def _identity_claim(claims: dict[str, Any], name: str) -> str | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_CLAIM_CHARS
        or not all(" " <= ch <= "~" for ch in value)
    ):
        raise AuthError(
            f"claim {name!r} must be a non-empty string of at most {MAX_CLAIM_CHARS} printable ASCII characters"
        )
    return value
