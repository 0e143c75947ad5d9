"""One error shape per API family (lifecycle.error_shapes), read by each family's own client: the server and
the proxy both answer through it, so a client raises the same exception type whoever refused the request."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from servers import ROOT
from text_generation.errors import (
    GenerationError,
    NotFoundError,
    OverloadedError,
    ShardTimeoutError,
    UnknownError,
    ValidationError,
    parse_error,
)

from lifecycle.error_shapes import ANTHROPIC, LLAMA_STACK, OPENAI, SHORTFIN, TGI, api_of, error_body, status_for

STATUSES = (400, 401, 404, 413, 429, 500, 502, 503, 504)


@pytest.mark.parametrize("status", STATUSES)
def test_text_generation_client_exception_types(status):
    err = parse_error(status_for(TGI, status), error_body(TGI, status, "why"))
    expected = {
        400: ValidationError,
        413: ValidationError,
        429: OverloadedError,
        503: OverloadedError,
        404: NotFoundError,
        500: GenerationError,
        504: ShardTimeoutError,
    }
    assert type(err) is expected.get(status, UnknownError) and str(err) == "why"


def _response(status: int, body: dict) -> httpx.Response:
    return httpx.Response(status, json=body, request=httpx.Request("POST", "http://127.0.0.1/x"))


@pytest.mark.parametrize("status", STATUSES)
def test_anthropic_client_reads_type_and_message(status):
    import anthropic

    client = anthropic.Anthropic(api_key="unused", base_url="http://127.0.0.1")
    body = error_body(ANTHROPIC, status, "why")
    err = client._make_status_error_from_response(_response(status, body))
    expected = {
        400: anthropic.BadRequestError,
        401: anthropic.AuthenticationError,
        404: anthropic.NotFoundError,
        413: anthropic.RequestTooLargeError,
        429: anthropic.RateLimitError,
        503: anthropic.ServiceUnavailableError,
    }
    assert isinstance(
        err, expected.get(status, anthropic.InternalServerError if status >= 500 else anthropic.APIStatusError)
    )
    assert err.status_code == status and err.body == body and "why" in err.message
    assert body["type"] == "error" and body["error"]["type"] != "api_error" or status >= 500
    assert api_of("/v1/messages") == api_of("/v1/messages/count_tokens") == ANTHROPIC
    assert api_of("/v1/chat/completions") == OPENAI


@pytest.mark.parametrize("status", STATUSES)
def test_openai_client_reads_type_and_message(status):
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1/v1")
    err = client._make_status_error_from_response(_response(status, error_body(OPENAI, status, "why", param="p")))
    expected = {
        400: openai.BadRequestError,
        401: openai.AuthenticationError,
        404: openai.NotFoundError,
        413: openai.APIStatusError,
        429: openai.RateLimitError,
    }
    assert isinstance(err, expected.get(status, openai.InternalServerError if status >= 500 else openai.APIStatusError))
    assert err.message.endswith("why") and err.param == "p" and err.status_code == status


@pytest.mark.parametrize("status", STATUSES)
def test_llama_stack_client_reads_detail(status):
    llama_stack_client = pytest.importorskip("llama_stack_client")
    client = llama_stack_client.LlamaStackClient(base_url="http://127.0.0.1", http_client=httpx.Client())
    err = client._make_status_error_from_response(_response(status, error_body(LLAMA_STACK, status, "why")))
    expected = {
        400: llama_stack_client.BadRequestError,
        401: llama_stack_client.AuthenticationError,
        404: llama_stack_client.NotFoundError,
        429: llama_stack_client.RateLimitError,
    }
    assert isinstance(
        err,
        expected.get(
            status, llama_stack_client.InternalServerError if status >= 500 else llama_stack_client.APIStatusError
        ),
    )
    assert err.body == {"detail": "why"}


def test_shortfin_codes():
    assert error_body(SHORTFIN, 400, "why") == {"error": "why", "code": "INVALID_REQUEST_ARGS"}
    assert error_body(SHORTFIN, 503, "busy") == error_body(SHORTFIN, 429, "busy") | {"error": "busy"}
    assert error_body(SHORTFIN, 429, "x")["code"] == "QUEUE_FULL"


def test_proxy_imports_the_shapes_without_torch_or_the_server():
    code = (
        "import sys, proxy.app, proxy.errors; "
        "bad = [m for m in ('torch', 'flask_inference', 'inference_api.web.app', 'inference_api.engine') "
        "if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
