"""Tool calling, with no transport: a request's tools and tool choice, what the model is shown, the grammar that
forces a call, and the calls parsed out of the model's text.

One output format for calls, Hermes' (what Qwen 2.5/3 and the Hermes models emit, and what their chat
templates show them): each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several
calls one right after another (nothing between them: given a newline to choose, a small model calls again and
again; without one, it ends its turn). ``tool_choice: "required"`` or a named function is enforced by a
grammar (a Lark grammar whose calls are JSON schemas: the name one of the tools', the arguments that tool's
``parameters``), so even a model never trained for tools returns calls that parse and match their schemas;
``auto`` lets the model write what it likes and parses the calls it wrote in that format (any other text stays
content); ``none`` does not show the model the tools.

A chat template that knows tools (its source names ``tools``) gets them and the calls in the history as
Hugging Face's templates take them; any other template (SmolLM2's ignores tools) gets plain messages: the
tools described at the end of the system message (one is added when there is none), assistant calls written
out in the call format, tool results as user turns in ``<tool_response>`` tags.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..engine.grammar import JSON_OPTIONS, Grammar, checked, json_schema, one_of
from ..engine.messages import SamplingParams
from ..request_errors import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tools:
    """A request's function tools (OpenAI's ``{"type": "function", "function": {...}}`` objects, checked) and how
    they may be used."""

    tools: tuple[dict, ...]  # each {"type": "function", "function": {"name", "description"?, "parameters"}}
    choice: str  # "none", "auto", "required", or "function" (forced: ``name``)
    name: str | None = None  # the function a named tool_choice forces
    parallel: bool = True  # several calls in one answer

    @property
    def offered(self) -> bool:
        """Whether the model is shown the tools and its text parsed for calls."""
        return self.choice != "none"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls (``required`` or a named function), enforced by ``grammar``."""
        return self.choice in ("required", "function")

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The parameters with the grammar a ``required`` or named choice imposes (every dialect's and the offline
        API's one merge; with another output constraint too: 400)."""
        if not self.forced:
            return params
        return dataclasses.replace(params, grammar=one_of(params.grammar, self.grammar(), field="tool_choice"))

    def grammar(self) -> Grammar | None:
        """The grammar a ``required`` or named choice imposes (None for auto and none)."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.name]
        calls = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
            }
            for t in chosen
        ]
        schema = {"x-guidance": JSON_OPTIONS, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
        text = (
            f"start: call{'+' if self.parallel else ''}\n"
            f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}\n"
        )
        return checked(Grammar("grammar", text), "tools")


def offered(tools: Tools | None) -> Tools | None:
    """The tools the model is shown and whose calls its text is parsed for: None without tools or with
    tool_choice none."""
    return tools if tools is not None and tools.offered else None


def parse_tools(tools, tool_choice, parallel_tool_calls) -> Tools | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (None: no tools; a tool choice with no
    tools is a 400, as OpenAI's)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice requires tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    checked_tools, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{name, parameters}}}}', where)
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise RequestError(
                f"{where}.function.name must be a non-empty string of at most 64 characters", f"{where}.function.name"
            )
        if name in seen:
            raise RequestError(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        field = f"{where}.function.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise RequestError(f"{field} must be a JSON schema of type object", field)
        json_schema(params, field)  # a 400 naming the field when llguidance cannot enforce it
        checked_tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    **({"description": description} if description else {}),
                    "parameters": params,
                },
            }
        )
    choice, forced = _choice(tool_choice, seen)
    return Tools(tuple(checked_tools), choice, forced, parallel_tool_calls is not False)


def _choice(tool_choice, names: set[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice in names and tool_choice not in CHOICES:  # TGI's form of a named function
            return "function", tool_choice
        if tool_choice not in CHOICES:
            raise RequestError(
                f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {tool_choice!r}",
                "tool_choice",
            )
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type", "function") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):  # TGI sends no type
        raise RequestError(
            'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if fn["name"] not in names:
        raise RequestError(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice.function.name")
    return "function", fn["name"]


# messages in the history
def assistant_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's shape, arguments a JSON string) as the chat template takes
    them: ``{"id", "type": "function", "function": {"name", "arguments": the object}}``."""
    if not isinstance(calls, list):
        raise RequestError(f"{where} must be a list of tool calls", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f'{at} must be {{"id", "type": "function", "function": {{name, arguments}}}}', at)
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError:
                raise RequestError(f"{at}.function.arguments is not valid JSON", f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise RequestError(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments")
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return out


def call_text(name: str, arguments: dict) -> str:
    """One call in the output format."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def tools_prompt(tools: Sequence[dict]) -> str:
    """The tools and the call format, for a chat template that does not take tools."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You can call these functions (one JSON object each):\n" + listed + "\n"
        "To call one, answer with " + OPEN + "\n"
        '{"name": "<function name>", "arguments": {<its arguments>}}\n'
        + CLOSE
        + " (one such block per call, nothing else); otherwise answer normally."
    )


def plain_messages(messages: Sequence[dict], tools: Sequence[dict] | None) -> list[dict]:
    """Messages for a template that knows nothing of tools: every content a string, the tools described in the
    system message, calls in the output format, tool results as user turns (one for consecutive results, so that
    templates that insist on alternating turns take them)."""
    out: list[dict] = []
    after_tool = False
    for msg in messages:
        content = msg.get("content") or ""
        if msg["role"] == "tool":  # the results of one turn's calls share one user turn, as Qwen's template does
            response = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
        elif msg.get("tool_calls"):
            calls = "".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"])
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({"role": msg["role"], "content": content})
        after_tool = msg["role"] == "tool"
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools_prompt(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


# calls in the model's output
@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, index: int | None = None) -> dict:
        return {
            **({"index": index} if index is not None else {}),
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_call(body: str, names: Sequence[str]) -> ToolCall | None:
    """The call in one ``<tool_call>`` block (None when it is not a call of one of ``names``)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(arguments, ensure_ascii=False))


# what CallSplitter gives: (kind, value) pairs
Piece = (
    tuple[Literal["content"], str]
    | tuple[Literal["call"], ToolCall]
    | tuple[Literal["open"], tuple[str, str]]  # incremental: the call's id and name
    | tuple[Literal["arguments"], str]  # incremental: more of the call's arguments
    | tuple[Literal["end"], None]  # incremental: the call is whole
)


class CallSplitter:
    """The model's text, as it arrives, split into content and calls: ``feed`` and, at the end, ``finish`` give
    ("content", text) and ("call", ToolCall) pieces. Text that may still turn into a call is held back; the
    whitespace around calls is dropped.

    ``incremental`` (a forced call, whose grammar guarantees the name first and a valid call): a call comes as
    ("open", (id, name)) once its name is known, then ("arguments", text) pieces of its arguments as they are
    written (the model's text of the object), and ("end", None)."""

    def __init__(self, names: Sequence[str], incremental: bool = False):
        self.names = tuple(names)
        self.incremental = incremental
        self.buf = ""
        self.inside = False
        self.calls = 0
        self.opened: int | None = None  # incremental: where the open call's arguments start in its text
        self.sent = 0  # incremental: how many characters of those arguments went out

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if self.incremental:
                    self._arguments(self.buf if end < 0 else self.buf[:end], out)
                if end < 0:
                    return out
                self._call(self.buf[:end], out, closed=True)
                self.buf, self.inside = self.buf[end + len(CLOSE) :], False
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                self._content(self.buf[:start], out, strip=True)
                self.buf, self.inside = self.buf[start + len(OPEN) :], True
                continue
            keep = _held(self.buf)
            self._content(self.buf[: len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep :]
            return out

    def take(self, text: str, finished: bool) -> list[Piece]:
        """``feed`` the text (if any), and at the answer's end ``finish`` too: one event's pieces."""
        pieces = self.feed(text) if text else []
        return pieces + self.finish() if finished else pieces

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.inside:
            self._call(self.buf, out, closed=False)
        else:
            self._content(self.buf, out, strip=self.calls > 0)
        self.buf, self.inside = "", False
        return out

    def _arguments(self, body: str, out: list[Piece]) -> None:
        """Incremental: the call's opening once its name is known, then its arguments so far."""
        if self.opened is None:
            start = _CALL_START.match(body)
            if start is None or json.loads(f'"{start.group(1)}"') not in self.names:
                return
            self.opened, self.sent = start.end(), 0
            out.append(("open", (f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{start.group(1)}"'))))
        arguments = body[self.opened :]
        written = _value_end(arguments)
        if written > self.sent:
            out.append(("arguments", arguments[self.sent : written]))
            self.sent = written

    def _call(self, body: str, out: list[Piece], closed: bool) -> None:
        if self.opened is not None:  # streamed as it came
            self.calls += 1
            self.opened = None
            out.append(("end", None))
            return
        call = parse_call(body, self.names)
        if call is None:
            self._content(OPEN + body + (CLOSE if closed else ""), out)
        else:
            self.calls += 1
            out.append(("call", call))

    def _content(self, text: str, out: list[Piece], strip: bool = False) -> None:
        if strip and not text.strip():
            return
        if text:
            out.append(("content", text))


# the start of a call whose grammar writes the name first: {"name": "...", "arguments": and the value's first
# character (so that the whitespace before it is never part of the arguments)
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def _value_end(text: str) -> int:
    """How much of ``text``, which starts with a JSON object, belongs to it: up to its closing brace, or all of it
    while it is still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _held(text: str) -> int:
    """How many characters at the end of ``text`` to hold back: whitespace, and the start of a ``<tool_call>``."""
    keep = 0
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            keep = n
            break
    rest = text[: len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())


def split_calls(text: str, names: Sequence[str], incremental: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a whole answer, as ``CallSplitter`` streams it: ``incremental`` (a forced
    call), each call's arguments are the model's text of them, a call cut short by max_tokens included (as
    OpenAI returns one)."""
    splitter = CallSplitter(names, incremental)
    pieces = splitter.feed(text) + splitter.finish()
    if not splitter.calls:
        return text, []
    calls: list[ToolCall] = []
    texts: list[str] = []
    opened: tuple[str, str] | None = None  # incremental: the open call's id and name...
    arguments = ""  # ...and its arguments so far
    for piece in pieces:
        match piece:
            case ("content", str() as text):
                texts.append(text)
            case ("call", ToolCall() as call):
                calls.append(call)
            case ("open", (str() as call_id, str() as name)):
                opened, arguments = (call_id, name), ""
            case ("arguments", str() as text):
                arguments += text
            case ("end", None) if opened is not None:
                calls.append(ToolCall(*opened, arguments))
    content = "".join(texts)
    return content.strip() or None, calls
