"""Every rejection is a 401 JSON body naming the reason, with WWW-Authenticate: Bearer; nothing reaches upstream."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import socket
import subprocess
import sys
import time
import uuid

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from proxy_helpers import ROOT, SECRET, bearer, free_port, make_token
from servers import wait_for

from proxy.auth import revocation_line, revoked_id


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def handmade_token(header: dict, claims: dict, key: bytes | None) -> str:
    """A token built by hand, for the forms PyJWT refuses to produce (alg none, HMAC over a public key)."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    signature = _b64(hmac.new(key, signing_input.encode(), hashlib.sha256).digest()) if key else ""
    return f"{signing_input}.{signature}"


CLAIMS = {"team_id": "team-a", "token_id": "token-1", "exp": int(time.time()) + 7200}
NOW = int(time.time())
TAMPERED = make_token().rsplit(".", 2)
TAMPERED = f"{TAMPERED[0]}.{_b64(json.dumps({'team_id': 'team-z', 'token_id': 'x'}).encode())}.{TAMPERED[2]}"

REJECTIONS = [
    ("no header", None, "missing Authorization"),
    ("basic scheme", "Basic dXNlcjpwYXNz", "scheme"),
    ("token without scheme", make_token(), "scheme"),
    ("empty bearer", "Bearer ", "empty bearer token"),
    ("not a jwt", "Bearer not-a-jwt", "malformed"),
    ("three garbage parts", "Bearer a.b.c", "malformed"),
    ("bad signature", "Bearer " + make_token(secret="another-secret-that-is-long-enough-0123456789"), "signature"),
    ("tampered claims", "Bearer " + TAMPERED, "signature"),
    ("alg none", "Bearer " + handmade_token({"alg": "none", "typ": "JWT"}, CLAIMS, None), "none"),
    ("alg None", "Bearer " + handmade_token({"alg": "None", "typ": "JWT"}, CLAIMS, None), "none"),
    ("alg not allowed", "Bearer " + make_token(algorithm="HS512"), "HS512"),
    ("expired", "Bearer " + make_token(exp=NOW - 3600), "expired"),
    ("not yet valid", "Bearer " + make_token(nbf=NOW + 3600), "not yet valid"),
    ("missing team_id", "Bearer " + make_token({"token_id": "t"}), "team_id"),
    ("missing token_id", "Bearer " + make_token({"team_id": "t"}), "token_id"),
    ("empty claims", "Bearer " + make_token({}), "missing the required claim"),
    ("team_id not a string", "Bearer " + make_token({"team_id": ["a"], "token_id": "t"}), "team_id"),
]


def assert_401(response: requests.Response, fragment: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    body = response.json()
    assert body["status_code"] == 401
    assert fragment.lower() in body["message"].lower(), body["message"]
    assert response.headers["X-Request-Id"]


@pytest.mark.parametrize("name, authorization, fragment", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_rejections_are_401_json(proxy, stub, name, authorization, fragment):
    path = f"/inference/model-{uuid.uuid4().hex}"
    headers = {"Authorization": authorization} if authorization is not None else {}
    response = requests.post(proxy.url + path, json={"text": "hi"}, headers=headers, timeout=10)
    assert_401(response, fragment)
    assert response.headers["WWW-Authenticate"].startswith("Bearer realm=")
    assert not any(path in seen for seen in stub.seen), "a rejected request reached upstream"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
        ("POST", "/predictions/m"),
        ("DELETE", "/x/y"),
        ("POST", "/health"),
        ("GET", "/health/"),
        ("POST", "/"),
        ("GET", "/playground/"),
        ("OPTIONS", "/inference/m"),
        ("HEAD", "/inference/m"),
    ],
)
def test_every_path_but_get_health_and_the_chat_page_needs_a_token(proxy, method, path):
    response = requests.request(method, proxy.url + path, timeout=10)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    if method != "HEAD":
        assert "Authorization" in response.text  # in the shape of the API of the path (test_error_shapes)


MISSING = "missing Authorization header (expected 'Bearer <token>', or x-api-key: <token>)"


@pytest.mark.parametrize(
    "path, sent, expected",
    [
        (
            "/v1/chat/completions",
            {},
            {"error": {"message": MISSING, "type": "authentication_error", "param": None, "code": None}},
        ),
        ("/generate", {"inputs": "x"}, {"error": MISSING}),
        ("/generate", {"text": "x"}, {"error": MISSING, "code": None}),
        ("/inference/completion", {}, {"detail": MISSING}),
        ("/inference/m", {}, {"status_code": 401, "message": MISSING}),
    ],
)
def test_401_body_speaks_the_api_of_the_request(proxy, path, sent, expected):
    assert requests.post(proxy.url + path, json=sent, timeout=10).json() == expected


def test_a_script_name_header_does_not_walk_a_path_around_the_token_check(proxy, stub):
    """gunicorn trusted SCRIPT_NAME from loopback: /v1/models/x/health with SCRIPT_NAME /v1/models/x looked like the
    public /health to the check and reached the upstream without a token."""
    response = requests.get(proxy.url + "/v1/models/x/health", headers={"SCRIPT_NAME": "/v1/models/x"}, timeout=10)
    assert response.status_code == 401 and "missing Authorization" in response.json()["error"]["message"]


def test_a_body_nested_past_the_parsers_depth_gets_the_401_json(proxy):
    """The proxy reads a shared path's small body for its error shape: "[" * 5000 must not raise (it was an HTML
    500 and a traceback per request)."""
    response = requests.post(
        proxy.url + "/generate", data="[" * 5000, headers={"Content-Type": "application/json"}, timeout=10
    )
    assert response.status_code == 401 and response.json()["error"] == MISSING


def test_health_is_public_with_the_status_only(proxy):
    """Without a token, and with a team's, /health says only whether the service is up (the server's details, its
    pid, model path, memory and failures, are for operators); with an admin token it is the server's whole answer."""
    response = requests.get(proxy.url + "/health", timeout=10)
    assert response.status_code == 200 and response.json() == {"status": "ready"}
    assert requests.head(proxy.url + "/health", timeout=10).status_code == 200
    team = requests.get(proxy.url + "/health", headers=bearer(make_token()), timeout=10)
    assert team.status_code == 200 and team.json() == {"status": "ready"}
    not_true = requests.get(proxy.url + "/health", headers=bearer(make_token(admin="true")), timeout=10)
    assert not_true.json() == {"status": "ready"}  # only JSON true makes an operator
    full = requests.get(proxy.url + "/health", headers=bearer(make_token(admin=True)), timeout=10)
    assert full.status_code == 200 and full.json()["model"] == "stub-model"
    assert_401(requests.get(proxy.url + "/health", headers={"Authorization": "Bearer x.y.z"}, timeout=10), "malformed")


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
@pytest.mark.parametrize("path", ["/metrics", "//metrics", "/metrics/", "/%6detrics"])
def test_metrics_need_an_admin_token(proxy, stub, method, path):
    """/metrics shows every team's traffic: a team's token gets 403 (JSON, never forwarded), an operator's passes."""
    marker = f"?m={uuid.uuid4().hex}"
    assert requests.request(method, proxy.url + path + marker, timeout=10).status_code == 401
    refused = requests.request(method, proxy.url + path + marker, headers=bearer(make_token()), timeout=10)
    assert refused.status_code == 403 and refused.headers["Content-Type"] == "application/json"
    if method != "HEAD":
        assert "admin claim" in refused.json()["message"]
    assert not any(marker in seen for seen in stub.seen), "a team's /metrics reached the upstream"
    if path == "/metrics":
        admin = requests.request(method, proxy.url + path + marker, headers=bearer(make_token(admin=True)), timeout=10)
        assert admin.status_code == 200 and any(marker in seen for seen in stub.seen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "framing", ["Content-Length: 1048576", "Transfer-Encoding: chunked"], ids=["content-length", "chunked"]
)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_the_public_health_takes_no_body(proxy, method, framing):
    """A public route never reads a body (300 stalled 1 MiB uploads to /health grew the proxy by 380 MB): one that
    is declared gets 413 at once, unread, and the connection closed; the body timeout (30 s) is never waited for."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"{method} /health HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode())  # and no body
        sock.settimeout(25)  # under the body timeout: an answer that waited for the body would not come in time
        answer = b""
        while piece := sock.recv(65536):  # read until the proxy closes the connection
            answer += piece
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower(), answer
    if method == "GET":
        assert json.loads(body)["message"] == "GET /health takes no request body"
    empty = requests.get(proxy.url + "/health", headers={"Content-Length": "0"}, timeout=10)
    assert empty.status_code == 200 and empty.json() == {"status": "ready"}


def test_valid_token_passes(proxy):
    response = requests.get(proxy.url + "/echo", headers=bearer(make_token()), timeout=10)
    assert response.status_code == 200
    assert response.json()["method"] == "GET"


def test_exp_required_by_default_and_leeway(stub, make_proxy):
    strict = make_proxy(stub.url, "--jwt-leeway", "0")
    assert_401(requests.get(strict.url + "/echo", headers=bearer(make_token(exp=None)), timeout=10), "exp")
    now = int(time.time())
    ok = requests.get(strict.url + "/echo", headers=bearer(make_token(exp=now + 60)), timeout=10)
    assert ok.status_code == 200
    assert_401(requests.get(strict.url + "/echo", headers=bearer(make_token(exp=now - 10)), timeout=10), "expired")
    lenient = make_proxy(stub.url, "--jwt-leeway", "60", "--no-jwt-require-exp")
    assert requests.get(lenient.url + "/echo", headers=bearer(make_token(exp=now - 10)), timeout=10).status_code == 200
    assert requests.get(lenient.url + "/echo", headers=bearer(make_token(exp=None)), timeout=10).status_code == 200


def test_a_revoked_token_id_is_refused_without_a_restart(stub, make_proxy, tmp_path):
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# revoked token_ids\nsomeone-else\n")
    proxy = make_proxy(stub.url, "--jwt-revoked-file", str(revoked))
    token = make_token(token_id="key-7")
    assert requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10).status_code == 200
    revoked.write_text("# revoked token_ids\nsomeone-else\nkey-7  # leaked\n")
    # re-read within a second of the change
    assert wait_for(lambda: requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10).status_code == 401, 10)
    assert_401(requests.get(proxy.url + "/echo", headers=bearer(token), timeout=10), "revoked")
    assert (
        requests.get(proxy.url + "/echo", headers=bearer(make_token(token_id="key-8")), timeout=10).status_code == 200
    )


@pytest.mark.parametrize("token_id", ["#x", " a ", "a#b", '"q"', "7"])
def test_revocation_matches_the_token_id_exactly(token_id):
    """An id a plain line cannot hold (a '#', outer spaces, a leading quote) goes as a JSON string, read back
    exactly; a plain line stays as it was (stripped, '#' comments)."""
    line = revocation_line(token_id)
    assert revoked_id(line) == token_id
    assert line == token_id if token_id == "7" else line == json.dumps(token_id)
    assert revoked_id("  key-7  # leaked") == "key-7" and revoked_id("# a comment") is None and revoked_id("") is None
    assert revoked_id('"a#b"  # JSON, then a comment') == "a#b"
    assert revoked_id('"unterminated') == '"unterminated'  # not JSON: the plain reading, as before


def test_revoked_ids_with_hashes_and_spaces_get_401(stub, make_proxy, tmp_path):
    """A token_id with '#' or outer spaces could not be revoked (the file stripped lines and cut at '#')."""
    ids = ["#x", " a ", "a#b"]
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# revoked token_ids\n" + "".join(revocation_line(i) + "\n" for i in ids))
    proxy = make_proxy(stub.url, "--jwt-revoked-file", str(revoked))
    for token_id in ids:
        assert_401(
            requests.get(proxy.url + "/echo", headers=bearer(make_token(token_id=token_id)), timeout=10), "revoked"
        )
    for token_id in ["a", "x", "a #b"]:  # what the old reading made of those lines, and a near miss: not revoked
        assert requests.get(proxy.url + "/echo", headers=bearer(make_token(token_id=token_id)), timeout=10).ok


def _key_pair(kind: str):
    private = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if kind == "RS256"
        else ec.generate_private_key(ec.SECP256R1())
    )
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private, public_pem


@pytest.mark.parametrize("alg", ["RS256", "ES256"])
def test_public_key_algorithms(stub, make_proxy, tmp_path, alg):
    private, public_pem = _key_pair(alg)
    other, _ = _key_pair(alg)
    key_file = tmp_path / "public.pem"
    key_file.write_bytes(public_pem)
    proxy = make_proxy(stub.url, "--jwt-algorithms", f"{alg},HS256", "--jwt-public-key-file", str(key_file))
    good = jwt.encode(CLAIMS, private, algorithm=alg)
    response = requests.get(proxy.url + "/echo", headers=bearer(good), timeout=10)
    assert response.status_code == 200
    assert ["X-Team-Id", "team-a"] in response.json()["headers"]
    assert requests.get(proxy.url + "/echo", headers=bearer(make_token()), timeout=10).status_code == 200
    assert_401(
        requests.get(proxy.url + "/echo", headers=bearer(jwt.encode(CLAIMS, other, algorithm=alg)), timeout=10),
        "signature",
    )
    # key confusion: an HS256 token whose HMAC key is the public key must not pass
    confused = handmade_token({"alg": "HS256", "typ": "JWT"}, CLAIMS, public_pem)
    assert_401(requests.get(proxy.url + "/echo", headers=bearer(confused), timeout=10), "signature")
    hs_only = jwt.encode(CLAIMS, private, algorithm=alg)
    assert_401(requests.get(make_proxy(stub.url).url + "/echo", headers=bearer(hs_only), timeout=10), alg)


def _run_proxy(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "JWT_SECRET"}
    return subprocess.run(
        [sys.executable, "-m", "proxy", "--host", "127.0.0.1", "--port", str(free_port()), *flags],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_refuses_to_start_without_secret():
    result = _run_proxy({})
    assert result.returncode == 2
    assert "JWT_SECRET is required" in result.stderr
    result = _run_proxy({"JWT_SECRET": SECRET}, "--jwt-algorithms", "RS256")
    assert result.returncode == 2 and "public-key-file" in result.stderr


def test_a_short_secret_stops_the_start(stub):
    """A secret under 32 bytes can be guessed: the proxy refuses to start and says why."""
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "proxy", "--upstream", stub.url, "--port", "1"],
        env={**os.environ, "JWT_SECRET": "short"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "only 5 bytes" in result.stderr and "at least 32" in result.stderr
