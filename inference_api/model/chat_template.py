"""A chat template rendered as transformers renders it (``apply_chat_template``), without transformers: the same
jinja2 environment (sandboxed, ``trim_blocks`` and ``lstrip_blocks``, loop controls, the ``{% generation %}`` tag,
its ``tojson``, ``raise_exception`` and ``strftime_now``) and the same variables (the messages, the tools, the
documents, ``add_generation_prompt`` and the tokenizer's special tokens by name). JsonTokenizer renders a converted
GGUF's template with it, so that the web worker of a GGUF never imports transformers (tests/test_model_loader.py
checks the prompt ids against transformers' on four templates, tools among them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any


def compile_template(source: str) -> Any:
    """The jinja2 template of ``source`` in transformers' environment (utils/chat_template_utils.py)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag): its body as written."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # (transformers' own: jinja's escapes HTML characters)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render(template: Any, messages: Sequence[dict], tools: Sequence[dict] | None, specials: dict[str, Any]) -> str:
    """The prompt for ``messages`` with the generation prompt added (``specials``: the tokenizer's special tokens
    by name, which transformers passes to every template)."""
    return template.render(
        **specials, messages=list(messages), tools=list(tools) if tools else None, documents=None,
        add_generation_prompt=True,
    )  # fmt: skip
