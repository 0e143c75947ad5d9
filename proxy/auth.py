"""Bearer-token checks. Every rejection is an AuthError whose message names the reason (never the token)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jwt

from .config import HMAC_ALGORITHMS, ProxyConfig

# claims passed upstream in headers; their values must be safe as header values
IDENTITY_CLAIMS = ("team_id", "token_id")
MAX_CLAIM_CHARS = 256


class AuthError(Exception):
    """401: the request carries no acceptable token."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Identity:
    team_id: str | None
    token_id: str | None


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header."""
    if not authorization or not authorization.strip():
        raise AuthError("missing Authorization header (expected 'Bearer <token>')")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        raise AuthError(f"unsupported Authorization scheme {scheme[:20]!r} (expected 'Bearer <token>')")
    token = token.strip()
    if not token:
        raise AuthError("empty bearer token")
    return token


class TokenVerifier:
    def __init__(self, config: ProxyConfig):
        self._config = config

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
        required = list(c.jwt_required_claims) + (["exp"] if c.jwt_require_exp else [])
        options = {"require": required, "verify_aud": c.jwt_audience is not None,
                   "verify_iss": c.jwt_issuer is not None}
        try:
            claims = jwt.decode(token, key, algorithms=[alg], options=options, leeway=c.jwt_leeway,
                                audience=c.jwt_audience, issuer=c.jwt_issuer)
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
        return Identity(**{name: _identity_claim(claims, name) for name in IDENTITY_CLAIMS})


def _identity_claim(claims: dict[str, Any], name: str) -> str | None:
    value = claims.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value or len(value) > MAX_CLAIM_CHARS \
            or not all(" " <= ch <= "~" for ch in value):
        raise AuthError(f"claim {name!r} must be a non-empty string of at most {MAX_CLAIM_CHARS} printable "
                        "ASCII characters")
    return value
