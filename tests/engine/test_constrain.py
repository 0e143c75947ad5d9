"""The grammar compile queue: teams in turn, a bounded number of a team's requests compiling at once, and a
grammar that fails at its first tokens refused while it is built."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest

from inference_api.engine.constrain import FairQueue, for_tokenizer
from inference_api.engine.engine import MAX_COMPILING_PER_TEAM, Engine
from inference_api.engine.grammar import Grammar
from inference_api.engine.messages import ErrorKind, FinishReason, GenerateRequest, SamplingParams
from inference_api.mock.runner import MockRunner
from inference_api.mock.tokenizer import EOS, ByteTokenizer


def test_the_fair_queue_takes_the_keys_in_turn():
    """Team a queues five jobs before team b's one: b's runs after a's running job and at most one more of a's,
    not after all of them."""
    queue, gate, order = FairQueue("test"), threading.Event(), []

    def job(name: str) -> str:
        if name == "a1":
            gate.wait(10)
        order.append(name)
        return name

    futures = [queue.submit("a", job, "a1")]
    futures += [queue.submit("a", job, f"a{i}") for i in range(2, 6)]
    futures.append(queue.submit("b", job, "b1"))
    gate.set()
    assert [f.result(10) for f in futures] == ["a1", "a2", "a3", "a4", "a5", "b1"]
    assert order.index("b1") <= 2 and order[0] == "a1"  # (a2 may run first: a was idle when a1 was taken)
    assert [name for name in order if name != "b1"] == ["a1", "a2", "a3", "a4", "a5"]


def test_a_failing_job_fails_only_its_future():
    queue = FairQueue("test")
    bad = queue.submit("a", lambda: 1 / 0)
    good = queue.submit("a", lambda: 7)
    with pytest.raises(ZeroDivisionError):
        bad.result(10)
    assert good.result(10) == 7


class PendingConstraints:
    """Grammars that never finish compiling, to count a team's requests in the queue."""

    def __init__(self):
        self.compiled: list[object] = []

    def compile(self, grammar, team=None) -> Future:
        self.compiled.append(team)
        return Future()


def test_a_team_past_its_compiling_requests_gets_busy_and_other_teams_do_not():
    constraints = PendingConstraints()
    engine = Engine(MockRunner(4, 0), ByteTokenizer(), 4, 4096, 64, frozenset([EOS]), constraints=constraints)
    params = SamplingParams(grammar=Grammar("regex", "a+"))
    for i in range(MAX_COMPILING_PER_TEAM + 1):
        engine.add(GenerateRequest(f"a{i}", tuple(b"x"), params, team="a"))
    engine.add(GenerateRequest("b0", tuple(b"x"), params, team="b"))
    events = engine.step()
    assert [(e.session_id, e.finish_reason, e.error_kind) for e in events] == [
        (f"a{MAX_COMPILING_PER_TEAM}", FinishReason.ERROR, ErrorKind.BUSY)
    ]
    assert constraints.compiled == ["a"] * MAX_COMPILING_PER_TEAM + ["b"]


@pytest.fixture(scope="module")
def constraints(hf_tokenizer):
    return for_tokenizer(hf_tokenizer, len(hf_tokenizer.tok), [hf_tokenizer.eos_token_id])


def test_a_schema_that_fails_at_its_first_token_fails_while_it_is_built(constraints):
    """2,000 optional properties pass llguidance's compile but not its parser's row limit at the first '{'."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(ValueError, match="items"):
        constraints.compile(Grammar("json_schema", json.dumps(wide)), "team").result(120)
    narrow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}
    matcher = constraints.compile(Grammar("json_schema", json.dumps(narrow)), "team").result(120)
    assert not matcher.is_error()
