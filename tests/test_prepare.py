"""Request preparation without a server or an engine: prompts into ids, max_tokens defaults, the context fit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from jinja2 import TemplateError

from inference_api.engine.messages import SamplingParams
from inference_api.mock.tokenizer import ByteTokenizer
from inference_api.request.prepare import DEFAULT_MAX_TOKENS, Prompt, encode, engine_params, prepare
from inference_api.request_errors import RequestError


class PickyTemplate(ByteTokenizer):
    def encode_chat(self, messages):
        raise TemplateError("roles must alternate")


def test_prompts_become_ids():
    tok = ByteTokenizer()
    assert encode(tok, Prompt(text="ab")) == [97, 98]
    assert encode(tok, Prompt(ids=(5, 6))) == [5, 6]
    assert encode(tok, Prompt(messages=[{"role": "user", "content": "x"}])) == list(b"<|user|>x\n<|assistant|>")


def test_a_refused_template_names_the_prompt_field():
    with pytest.raises(RequestError) as err:
        encode(PickyTemplate(), Prompt(messages=[{"role": "user", "content": "x"}], field="text"))
    assert err.value.field == "text" and "roles must alternate" in err.value.message


def test_max_tokens_defaults_to_what_fits():
    assert engine_params([1] * 10, SamplingParams(max_tokens=None), 2048).max_tokens == DEFAULT_MAX_TOKENS
    assert engine_params([1] * 2000, SamplingParams(max_tokens=None), 2048).max_tokens == 48
    assert engine_params([1] * 10, SamplingParams(max_tokens=None), 2048, default_max=100).max_tokens == 100
    with pytest.raises(RequestError, match="plus max_tokens \\(1\\)"):  # at least one token, which must fit
        engine_params([1] * 2048, SamplingParams(max_tokens=None), 2048)
    ids, params = prepare(ByteTokenizer(), 64, Prompt(text="hi"), SamplingParams(temperature=0, max_tokens=5))
    assert ids == [104, 105] and params == SamplingParams(temperature=0, max_tokens=5)


def test_what_does_not_fit_names_the_field():
    with pytest.raises(RequestError) as err:
        engine_params([1] * 60, SamplingParams(max_tokens=5), 64, field="max_new_tokens")
    assert err.value.kind == "invalid" and err.value.field == "max_new_tokens"
    assert err.value.message == "prompt (60 tokens) plus max_new_tokens (5) exceeds the context length of 64 tokens"
    with pytest.raises(RequestError) as err:
        engine_params([], SamplingParams(max_tokens=5), 64)
    assert err.value.field is None and err.value.message == "the prompt is empty (no tokens)"
    with pytest.raises(RequestError) as err:
        prepare(ByteTokenizer(), 64, Prompt(text=""), SamplingParams(max_tokens=5), prompt_field="prompt")
    assert err.value.field == "prompt"


def test_no_transport_below_the_routes():
    """Preparation, the parsers and the formatters load without Flask (the offline API does not need it)."""
    modules = ["inference_api.request.prepare", "inference_api.offline.llm"] + [
        f"inference_api.web.dialects.{d}.{m}"
        for d in ("openai", "tgi", "native", "llama_stack", "shortfin")
        for m in ("protocol", "format")
    ]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('flask' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
