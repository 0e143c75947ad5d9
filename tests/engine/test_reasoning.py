"""A row's thought (engine/reasoning.py) through its Sequence: the thought's text apart from the answer's, tags
and the whitespace around them dropped, with the tags spelled in one token or in several, streamed piece by piece
or whole; its token count, the budget's forced close, and the grammar held off while it thinks."""

import itertools
import random

import pytest

from inference_api.engine.messages import FinishReason, GenerateRequest, Reasoning, SamplingParams
from inference_api.engine.sequence import Sequence

EOS = 0
CLOSE = ("</think>",)  # the tokens a forced close writes


class Vocab:
    """Token ids for strings, made up as they come (one id per distinct piece)."""

    def __init__(self):
        self.pieces: list[str] = ["<eos>"]

    def id(self, piece: str) -> int:
        if piece not in self.pieces:
            self.pieces.append(piece)
        return self.pieces.index(piece)

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids if i != EOS)


def run(pieces, inside=False, budget=None, split=True, grammar=False, vocab=None):
    """Feed the pieces (one token each, forced tokens taking the place of the next piece) and gather
    (thought, answer, reasoning tokens, tokens fed, seq)."""
    vocab = vocab or Vocab()
    close = tuple(vocab.id(p) for p in CLOSE)
    spec = Reasoning(inside=inside, budget=budget, close_ids=close, split=split)
    params = SamplingParams(max_tokens=1000, reasoning=spec)
    if grammar:
        from inference_api.engine.grammar import Grammar

        params = SamplingParams(max_tokens=1000, reasoning=spec, grammar=Grammar("regex", "a+"))
    seq = Sequence(GenerateRequest("s", (vocab.id("<prompt>"),), params), vocab.decode)
    thought, answer, fed = [], [], []
    queue = list(pieces)
    while queue and not seq.is_finished:
        token = seq.forced if seq.forced is not None else vocab.id(queue.pop(0))
        fed.append(vocab.pieces[token])
        answer.append(seq.append(token, frozenset({EOS}), 10_000))
        thought.append(seq.pending_reasoning)
        seq.pending_reasoning = ""
    if not seq.is_finished:
        answer.append(seq.finish(FinishReason.EOS))
        thought.append(seq.pending_reasoning)
    return "".join(thought), "".join(answer), seq.reasoning_tokens, fed, seq


def test_a_thought_the_model_opens_is_split_from_the_answer():
    thought, answer, n, _, _ = run(["<think>", "\n", "let me", " see", "\n", "</think>", "\n\n", "The", " answer"])
    assert (thought, answer) == ("let me see", "The answer")
    assert n == 6  # the thought's tokens, both tags included


def test_an_answer_without_a_thought_is_all_answer():
    thought, answer, n, _, _ = run([" Hello", " <think>", " there"])
    assert (thought, answer, n) == ("", " Hello <think> there", 0)


def test_a_thought_open_from_the_first_token_needs_no_start_tag():
    thought, answer, n, _, _ = run(["Hmm", ",", " ok", "</think>", "Yes"], inside=True)
    assert (thought, answer, n) == ("Hmm, ok", "Yes", 4)
    # a start tag the model writes anyway is not part of the thought
    thought, answer, _, _, _ = run(["<think>", "\n", "Hmm", "</think>", "Yes"], inside=True)
    assert (thought, answer) == ("Hmm", "Yes")


def test_tags_spelled_in_several_tokens_are_found():
    thought, answer, _, _, _ = run(["<th", "ink>", "a", " b </", "thi", "nk>", " c"])
    assert (thought, answer) == ("a b", "c")


def test_an_unfinished_thought_is_all_thought():
    thought, answer, n, _, _ = run(["<think>", "still", " going"])
    assert (thought, answer, n) == ("still going", "", 3)


def test_split_off_streams_the_text_as_written_and_still_counts():
    text = ["<think>", "x", "</think>", "y"]
    thought, answer, n, _, _ = run(text, split=False)
    assert (thought, answer, n) == ("", "".join(text), 3)


@pytest.mark.parametrize("seed", range(30))
def test_streamed_pieces_add_up_to_the_whole(seed):
    """However the text is cut into tokens, the split is the same as of the whole text."""
    rng = random.Random(seed)
    text = rng.choice(["", " ", "\n"]) + "<think>\n" + "a b </c> d" * rng.randint(0, 3) + "\n</think>\n\n" + "ans </x>"
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) - 1)))
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    thought, answer, _, _, _ = run(pieces)
    body = text.split("<think>", 1)[1].split("</think>")[0].strip()
    assert (thought, answer) == (body, "ans </x>")


def test_the_budget_forces_the_close_then_the_model_answers():
    thought, answer, n, fed, _ = run(["<think>", "a", " b", " Done"], budget=2)
    assert fed == ["<think>", "a", " b", *CLOSE, " Done"]  # the forced tokens come before the model's next
    assert (thought, answer) == ("a b", "Done")
    assert n == 3 + len(CLOSE)


def test_budget_zero_closes_at_once():
    _, answer, _, fed, _ = run(["x", "y"], inside=True, budget=0)
    assert fed == [*CLOSE, "x", "y"]
    assert answer == "xy"
    _, answer, _, fed, _ = run(["<think>", "x", "y"], budget=0)
    assert fed == ["<think>", *CLOSE, "x", "y"]
    assert answer == "xy"


def test_no_close_is_forced_on_a_thought_already_closed():
    _, _, _, fed, _ = run(["<think>", "a", "</think>", "b", "c", "d"], budget=2)
    assert fed == ["<think>", "a", "</think>", "b", "c", "d"]


def test_a_grammar_constrains_only_the_answer():
    *_, seq = run(["<think>", "a"], inside=True, grammar=True)
    assert not seq.grammar_active  # thinking: not constrained
    *_, seq = run(["<think>", "a", "</think>"], inside=True, grammar=True)
    assert seq.grammar_active
    # not inside at the start: a constrained row gets no thought, its grammar holds from the first token
    thought, answer, _, _, seq = run(["<think>", "a"], grammar=True)
    assert seq.grammar_active and (thought, answer) == ("", "<think>a")
