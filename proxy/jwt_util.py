"""Make and check the proxy's JSON Web Tokens (HMAC): the ``jwt-util`` command of an installed package, or
``scripts/jwt_util.py`` in a checkout.

    export JWT_SECRET=...                                       # never a flag: process lists show flags
    ./scripts/jwt_util.py encode '{"team_id": "tenstorrent", "token_id": "debug-test"}'   # expires in 24 h
    ./scripts/jwt_util.py encode '{"team_id": "t", "token_id": "k"}' --expires-in 3600    # in an hour
    ./scripts/jwt_util.py encode '{"team_id": "ops", "token_id": "o"}' --admin            # an operator's token
    ./scripts/jwt_util.py decode "$TOKEN"                                                  # verified claims as JSON

The secret comes from the JWT_SECRET environment variable only. Every token gets iat and exp (the proxy requires
exp by default): --expires-in SECONDS (default 86400), or --no-expiry for a token that never ends (accepted
only by a proxy started with --no-jwt-require-exp). --admin adds the claim ``"admin": true``: an operator's token,
the only kind the proxy lets read /metrics and /health's details (give it to operators, never to a team).

To revoke a token, add its token_id as one line of the proxy's --jwt-revoked-file; an id with '#', outer spaces or
a leading '"' goes as a JSON string (``"a#b"``), which the proxy matches exactly (``proxy.auth.revocation_line``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jwt

HMAC_ALGORITHMS = ("HS256", "HS384", "HS512")


DEFAULT_LIFETIME = 86400  # seconds: a day


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Encode or decode the proxy's JWTs (secret: $JWT_SECRET).")
    # --algorithm is accepted before or after the command
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--algorithm", default=argparse.SUPPRESS, choices=HMAC_ALGORITHMS, help="signing algorithm (default HS256)"
    )
    parser.add_argument("--algorithm", default="HS256", choices=HMAC_ALGORITHMS, help="default HS256")
    commands = parser.add_subparsers(dest="command", required=True)
    encode = commands.add_parser("encode", parents=[common], help="print a signed token for a JSON claims object")
    encode.add_argument("payload", help='claims as a JSON object, e.g. \'{"team_id": "t", "token_id": "k"}\'')
    life = encode.add_mutually_exclusive_group()
    life.add_argument(
        "--expires-in",
        type=int,
        default=DEFAULT_LIFETIME,
        metavar="SECONDS",
        help=f"iat = now and exp = now + SECONDS (default {DEFAULT_LIFETIME})",
    )
    life.add_argument("--no-expiry", action="store_true", help="no exp claim (a token that never ends)")
    encode.add_argument(
        "--admin", action="store_true", help="add \"admin\": true: an operator's token (/metrics, /health's details)"
    )
    decode = commands.add_parser("decode", parents=[common], help="verify a token and print its claims as JSON")
    decode.add_argument("token")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    secret = os.environ.get("JWT_SECRET")
    if not secret:
        print("error: no secret: set JWT_SECRET in the environment", file=sys.stderr)
        return 2
    if args.command == "encode":
        try:
            claims = json.loads(args.payload)
        except json.JSONDecodeError as exc:
            print(f"error: payload is not valid JSON: {exc}", file=sys.stderr)
            return 2
        if not isinstance(claims, dict):
            print("error: payload must be a JSON object", file=sys.stderr)
            return 2
        if args.admin:
            claims = {**claims, "admin": True}
        if not args.no_expiry:
            now = int(time.time())
            claims = {**claims, "iat": now, "exp": now + args.expires_in}
        print(jwt.encode(claims, secret, algorithm=args.algorithm))
        return 0
    try:
        claims = jwt.decode(args.token, secret, algorithms=[args.algorithm])
    except jwt.PyJWTError as exc:
        print(f"error: invalid token: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(claims, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
