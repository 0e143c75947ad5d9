"""One row's thought: where a reasoning model's thinking sits in its output, what of it may be streamed, its
budget, and the tokens that close it.

A thought is one span at the start of the output, between the start tag (``<think>``) and the end tag
(``</think>``): the model opens it with the start tag, or it is open from the first token (``Reasoning.inside``:
the chat template ended the prompt inside one, or the model always thinks, as DeepSeek-R1's distills do; a start
tag written anyway is dropped). The tags are found in the text, so a tag that the vocabulary spells in several
tokens is found as well as a single one. The row's ``Sequence`` feeds the text after each token (``update``);
``safe`` says how much may be streamed (a part of a tag, and the whitespace around the thought, are held back
until they are known) and ``split`` divides a released span into the thought's text and the answer's, tags
dropped. With ``split`` off the text goes out as written; the thought is still tracked for its budget, its token
count and the grammar, which constrains only the answer.

The budget (``Reasoning.budget``) counts the thought's tokens; once it is spent with the thought still open the
row is made to close it: the next tokens are ``Reasoning.close_ids`` (llama-server's ``--reasoning-budget``),
drawn by the sampler in place of its own draw (``forced``).
"""

from __future__ import annotations

import enum
from collections import deque

from .messages import Reasoning


class Stage(enum.Enum):
    UNDECIDED = "undecided"  # the output so far (whitespace, part of the start tag) may still open a thought
    INSIDE = "inside"  # thinking
    DONE = "done"  # the thought closed: the rest is the answer
    NONE = "none"  # no thought: the whole output is the answer


class Thought:
    def __init__(self, spec: Reasoning, constrained: bool = False):
        self.spec = spec
        # a row with a grammar that does not start inside a thought gets none: the grammar holds from its first token
        self.stage = Stage.INSIDE if spec.inside else Stage.NONE if constrained else Stage.UNDECIDED
        self.opened = not spec.inside  # whether the start is known (inside from the first token: not yet seen)
        self.start = 0  # where the thought's text begins in the output text (after the start tag, and whitespace)
        self.end: int | None = None  # where the end tag begins
        self.answer: int | None = None  # where the answer begins (0: no thought); None while it is not known
        self.settled = False  # whether ``answer`` is past the whitespace that follows the end tag
        self.tokens = 0  # the output's tokens up to the thought's end (its tags included); 0 without a thought
        self.thinking = 0  # tokens since the thought opened (what the budget counts)
        self.checked = 0  # characters of the text already searched for the end tag
        self.forced: deque[int] = deque()  # the close's tokens still to come
        self.closing = False  # whether the close was forced (once: it ends the thought)
        if spec.inside and spec.budget == 0:
            self.close()

    @property
    def grammar_active(self) -> bool:
        """Whether a grammar constrains the next token: only the answer is constrained."""
        return self.stage in (Stage.DONE, Stage.NONE)

    @property
    def open(self) -> bool:
        return self.stage in (Stage.UNDECIDED, Stage.INSIDE)

    def update(self, text: str, token: int) -> None:
        """The output text after another token (``token``, which a forced close takes off its queue)."""
        if self.forced and self.forced[0] == token:
            self.forced.popleft()
        if self.stage is Stage.UNDECIDED:
            self.tokens += 1
            head = text.lstrip()
            if not head.startswith(self.spec.start):
                if not self.spec.start.startswith(head):
                    self.stage, self.answer, self.settled, self.tokens = Stage.NONE, 0, True, 0
                return
            self.stage, self.opened = Stage.INSIDE, True
            self.start = self.checked = len(text) - len(head) + len(self.spec.start)
            if self.spec.budget == 0:
                self.close()
        elif self.stage is Stage.INSIDE:
            self.tokens += 1
            head = text.lstrip() if not self.opened else ""
            if not self.opened and head.startswith(self.spec.start):
                # open from the first token: a start tag the model writes anyway is not the thought's
                self.opened = True
                self.start = self.checked = len(text) - len(head) + len(self.spec.start)
            else:
                self.opened = self.opened or not self.spec.start.startswith(head)
                self.thinking += 1
        else:
            return
        end_tag = self.spec.end
        at = text.find(end_tag, max(self.start, self.checked - len(end_tag) + 1))
        self.checked = len(text)
        if at >= 0:
            self.stage, self.end, self.answer = Stage.DONE, at, at + len(end_tag)
            self.forced.clear()
            return
        budget = self.spec.budget
        if budget is not None and self.thinking >= budget:
            self.close()

    def close(self) -> None:
        """Force the thought's close: its tokens are the next ones drawn."""
        if not self.closing:
            self.closing = True
            self.forced.extend(self.spec.close_ids)

    def safe(self, text: str, upto: int, finished: bool) -> int:
        """How much of the text may be streamed, of the ``upto`` characters the stop sequences allow: not a part
        of a tag, nor the whitespace at the thought's edges, while what it is is not known."""
        if finished or not self.spec.split:
            return upto
        if self.stage is Stage.UNDECIDED or (self.stage is Stage.INSIDE and not self.opened):
            return 0
        if self.stage is Stage.INSIDE:
            return _rstrip_end(text, upto - _tag_prefix(text, upto, self.spec.end))
        if self.stage is Stage.DONE and not self.settled:
            assert self.answer is not None
            rest = text[self.answer : upto]
            if not rest.strip():
                return self.end_of_thought()
            self.answer += len(rest) - len(rest.lstrip())
            self.settled = True
        return upto

    def end_of_thought(self) -> int:
        """Where the thought's streamable text ends (before the end tag and the whitespace before it)."""
        return self.end if self.end is not None else 0

    def split(self, text: str, a: int, b: int, finished: bool) -> tuple[str, str]:
        """(thought, answer) of the released span ``text[a:b]``, the tags and the whitespace around them dropped;
        at the end a thought still open keeps all the text (the budget or max_tokens ended it)."""
        if not self.spec.split:
            return "", text[a:b]
        if self.stage is Stage.UNDECIDED:  # (released only at the end: whitespace, or part of a start tag)
            return "", text[a:b]
        if self.stage is Stage.NONE:
            return "", text[a:b]
        start = self._thought_start(text)
        stop = _rstrip_end(text, b if self.stage is Stage.INSIDE else self.end_of_thought())
        thought = text[max(a, start) : max(max(a, start), min(b, stop))]
        if self.answer is None or (self.stage is Stage.DONE and not self.settled and not finished):
            return thought, ""
        answer_from = self.answer
        if not self.settled:  # finished with only whitespace after the end tag
            answer_from = b
        return thought, text[max(a, answer_from) : b]

    def _thought_start(self, text: str) -> int:
        """The thought's first character past the whitespace after the start tag (found once, then kept in
        ``start``: the whitespace is skipped as it comes)."""
        while self.start < len(text) and text[self.start].isspace():
            self.start += 1
        return self.start


def _tag_prefix(text: str, end: int, tag: str) -> int:
    """The length of the longest end of ``text[:end]`` that begins ``tag`` (a tag still being written)."""
    for n in range(min(len(tag) - 1, end), 0, -1):
        if tag.startswith(text[end - n : end]):
            return n
    return 0


def _rstrip_end(text: str, end: int) -> int:
    """Where ``text[:end]`` ends once its trailing whitespace is dropped (no copy of the text)."""
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end
