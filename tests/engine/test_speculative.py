"""Speculative decoding (engine/speculative.py) over mock runners: prompt-lookup drafts checked in one forward give
the same tokens as speculation off, greedy and seeded, and the target's distribution unseeded (a chi-square
test); stops, max_tokens, min_tokens, log-probs, n and the prefix cache keep their meaning; rows back off."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
import torch

from inference_api.engine.engine import Engine
from inference_api.engine.messages import FinishReason, GenerateRequest, SamplingParams
from inference_api.engine.speculative import RowDrafts, SpecConfig, StepCosts, kept
from inference_api.mock.runner import MockRunner
from inference_api.mock.tokenizer import EOS, VOCAB, ByteTokenizer

SPEC = SpecConfig(draft_max=6, ngram_min=2, ngram_max=4, max_rows=8)


class CountingRunner(MockRunner):
    """The mock ("Echo: <prompt> — " over and over), counting its forwards."""

    def __init__(self, rows: int):
        super().__init__(rows, tokens_per_second=0)
        self.forwards = 0

    def decode(self, rows, tokens, positions):
        self.forwards += 1
        return super().decode(rows, tokens, positions)

    def verify(self, rows, chunks, starts):
        self.forwards += 1
        return super().verify(rows, chunks, starts)


LETTERS = list(range(ord("a"), ord("a") + 6))


class NoisyRunner(CountingRunner):
    """Logits that depend on the position alone: at each position a fixed distribution over six letters (so
    sampled text repeats its n-grams often and drafts are made), the same whatever the batch."""

    def _logits(self, rows, next_positions):
        out = torch.full((len(rows), VOCAB), -1e9)
        for i, pos in enumerate(next_positions):
            g = torch.Generator().manual_seed(1000 + pos % 7)
            out[i, LETTERS] = torch.randn(len(LETTERS), generator=g) * 1.2
        return out


def engine(runner_cls=CountingRunner, spec: SpecConfig | None = SPEC, rows: int = 4) -> tuple[Engine, MockRunner]:
    runner = runner_cls(rows)
    eng = Engine(runner, ByteTokenizer(), rows, 4096, 64, frozenset([EOS]), spec=spec)
    eng.costs = FixedCosts()
    return eng, runner


def run(eng: Engine, requests: list[GenerateRequest]) -> dict[str, list]:
    for r in requests:
        eng.add(r)
    events = defaultdict(list)
    for _ in range(5000):
        if not eng.has_work:
            return events
        for event in eng.step():
            events[event.session_id].append(event)
    raise AssertionError("engine did not finish")


def ask(sid: str, prompt: str = "abcabc", **params) -> GenerateRequest:
    return GenerateRequest(
        sid, tuple(prompt.encode()), SamplingParams(**{"temperature": 0, "max_tokens": 60, **params})
    )


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_prompt_lookup_drafts_what_followed_the_latest_occurrence():
    drafts = RowDrafts(SPEC)
    assert drafts.propose([1, 2, 3, 4, 5], [9, 2, 3], 3) == [4, 5, 9]  # "2 3" was followed by 4 5 9
    assert drafts.propose([1, 2, 3, 4, 5], [9, 2, 3, 4, 7, 2, 3, 4], 2) == [7, 2]  # the latest "2 3 4"
    assert RowDrafts(SPEC).propose([1, 2, 3], [8], 3) == []  # no earlier "3 8"
    assert kept([4, 5, 9], [4, 5, 1, 0]) == 2 and kept([4], [1, 4]) == 0 and kept([], [3]) == 0


def test_a_rows_rate_falls_with_refused_drafts_and_recovers_while_it_waits():
    drafts = RowDrafts(SPEC)
    for _ in range(6):
        drafts.record(4, 0)
    low = drafts.acceptance
    assert low < 0.1
    for _ in range(100):
        drafts.idle()
    assert low < drafts.acceptance < 0.5


def test_drafts_are_taken_where_they_raise_the_rate():
    costs = StepCosts()
    sure, unsure = ([5, 6, 7, 8], 0.95), ([5, 6, 7, 8], 0.03)
    assert costs.choose(1, {0: sure}, 64) == {}  # no plain step of one row timed yet
    costs.record(1, 0, 0.010)
    costs.record(1, 8, 0.014)  # a drafted token adds 0.5 ms
    assert costs.choose(1, {0: sure}, 64) == {0: [5, 6, 7, 8]}
    assert costs.choose(1, {0: unsure}, 64) == {}  # 0.03 of a token for 5 % of a step: below the step's rate
    costs.record(32, 0, 0.010)  # 32 rows in a step as quick as one: each drafted token costs more than it brings
    assert costs.choose(32, {i: sure for i in range(32)}, 64) == {}
    assert sum(map(len, costs.choose(1, {0: sure, 1: sure}, 3).values())) == 3  # the step's limit


class FixedCosts(StepCosts):
    """The mock's steps take no measurable time: costs as a CPU's (a plain step 10 ms, a drafted token 1 ms)."""

    def __init__(self, per_token: float = 0.001):
        super().__init__()
        self.plain = {b: 0.010 for b in range(8)}
        self.per_token = per_token

    def record(self, rows, drafted, seconds):
        pass


def test_greedy_output_is_the_same_with_fewer_forwards():
    plain, plain_runner = engine(spec=None)
    spec, spec_runner = engine()
    prompts = ["abcabc", "hello hello", "xyz"]
    reqs = lambda: [ask(f"r{i}", p) for i, p in enumerate(prompts)]  # noqa: E731
    off, on = run(plain, reqs()), run(spec, reqs())
    assert {k: tokens(v) for k, v in on.items()} == {k: tokens(v) for k, v in off.items()}
    assert all(len(tokens(v)) == 60 for v in on.values())
    stats = spec.stats
    assert stats.spec_accepted_tokens > 60 and stats.spec_drafted_tokens >= stats.spec_accepted_tokens
    assert spec_runner.forwards < plain_runner.forwards * 0.6


@pytest.mark.parametrize("seed", range(12))
def test_seeded_sampling_is_the_same_tokens_with_and_without_speculation(seed):
    params = dict(temperature=1.0, seed=seed, max_tokens=40)
    off = run(engine(NoisyRunner, spec=None)[0], [ask("s", **params)])
    eng, _ = engine(NoisyRunner)
    on = run(eng, [ask("s", **params)])
    assert tokens(on["s"]) == tokens(off["s"])
    assert eng.stats.spec_drafted_tokens > 0


def chi_square_bins(counts: Counter, probs: dict[int, float], runs: int) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, with the rarest outcomes pooled into one bin until every
    bin expects at least 5 (below that the statistic's tail is far heavier than chi-square's)."""
    order = sorted(probs, key=probs.get)
    bins: list[list[int]] = [[]]
    for t in order:
        bins[-1].append(t)
        if runs * sum(probs[u] for u in bins[-1]) >= 5:
            bins.append([])
    if not bins[-1]:
        bins.pop()
    elif len(bins) > 1:
        bins[-2].extend(bins.pop())
    chi2 = 0.0
    for b in bins:
        expected = runs * sum(probs[t] for t in b)
        chi2 += (sum(counts.get(t, 0) for t in b) - expected) ** 2 / expected
    return chi2, len(bins) - 1


def chi_square_limit(df: int, z: float = 4.75) -> float:
    """The chi-square quantile z standard deviations out (4.75: one run in a million), Wilson and Hilferty."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def test_unseeded_samples_follow_the_models_distribution():
    """Each position's letter, over many unseeded requests with speculation on, against the model's own
    probabilities there: one chi-square over all positions (the drafts were checked and kept). Right sampling
    gives about its degrees of freedom (120); keeping unchecked drafts or a wrong residual gives several times."""
    eng, _ = engine(NoisyRunner, rows=8)
    eng.costs = FixedCosts(per_token=0.0001)  # drafts pay even at 8 rows and low rates: the test is of them
    runs, length = 240, 24
    out = run(eng, [ask(f"u{i}", prompt="ab", temperature=1.0, max_tokens=length) for i in range(runs)])
    assert eng.stats.spec_accepted_tokens > 60  # the test checks kept drafts, not plain steps alone
    prompt_len = 2
    runner = NoisyRunner(1)
    total, df = 0.0, 0
    for j in range(length):
        counts = Counter(tokens(out[f"u{i}"])[j] for i in range(runs))
        probs = torch.softmax(runner._logits([0], [prompt_len + j])[0, LETTERS], dim=-1).tolist()
        chi2, k = chi_square_bins(counts, dict(zip(LETTERS, probs)), runs)
        total, df = total + chi2, df + k
    assert total < chi_square_limit(df), (total, df)


def test_the_chi_square_check_can_fail():
    """The statistic above, on samples drawn from a slightly wrong distribution (a fifth of the mass moved to
    the likeliest letter), is far over its limit; on the right one it stays under."""
    g = torch.Generator().manual_seed(7)
    runner = NoisyRunner(1)
    wrong_total = right_total = 0.0
    df = 0
    for j in range(24):
        p = torch.softmax(runner._logits([0], [2 + j])[0, LETTERS], dim=-1)
        q = 0.8 * p + 0.2 * torch.nn.functional.one_hot(p.argmax(), len(LETTERS))
        right = Counter(LETTERS[i] for i in torch.multinomial(p, 240, True, generator=g).tolist())
        wrong = Counter(LETTERS[i] for i in torch.multinomial(q, 240, True, generator=g).tolist())
        chi2, k = chi_square_bins(right, dict(zip(LETTERS, p.tolist())), 240)
        right_total, df = right_total + chi2, df + k
        wrong_total += chi_square_bins(wrong, dict(zip(LETTERS, p.tolist())), 240)[0]
    assert right_total < chi_square_limit(df) < wrong_total


def test_stops_max_tokens_and_logprobs_keep_their_meaning():
    for params in (
        dict(stop=("o: ab",), max_tokens=60),
        dict(max_tokens=17),
        dict(max_tokens=30, logprobs=2),
        dict(max_tokens=30, min_tokens=25, stop_token_ids=(ord("E"),)),
    ):
        off = run(engine(spec=None)[0], [ask("a", **params)])["a"]
        on = run(engine()[0], [ask("a", **params)])["a"]
        assert tokens(on) == tokens(off) and "".join(e.text for e in on) == "".join(e.text for e in off), params
        assert on[-1].finish_reason == off[-1].finish_reason
        if params.get("logprobs"):
            assert [lp.token for e in on for lp in e.logprobs] == [lp.token for e in off for lp in e.logprobs]


def test_the_prefix_cache_holds_only_the_kept_tokens():
    eng, runner = engine()
    first = run(eng, [ask("one", max_tokens=40)])["one"]
    assert eng.stats.spec_accepted_tokens > 0
    held = eng.scheduler.prefixes._held
    row = next(i for i, (_, toks) in enumerate(held) if toks)
    ids = held[row][1]
    assert ids == list(b"abcabc") + tokens(first)[: len(ids) - 6]
    assert runner._cached[row][: len(ids)] == ids  # what the row's cache holds at those positions
    again = run(eng, [ask("two", max_tokens=40)])["two"]
    assert tokens(again) == tokens(first)


def test_the_per_request_switch_and_the_rows_limit():
    eng, _ = engine()
    run(eng, [ask("off", speculate=False)])
    assert eng.stats.spec_drafted_tokens == 0
    eng, _ = engine(spec=SpecConfig(draft_max=6, max_rows=1), rows=4)
    run(eng, [ask(f"r{i}") for i in range(3)])
    busy = eng.stats.spec_drafted_tokens
    eng2, _ = engine(spec=SpecConfig(draft_max=6, max_rows=1), rows=4)
    run(eng2, [ask("alone")])
    assert busy <= eng2.stats.spec_drafted_tokens  # three rows at once drafted only once the others ended


def test_n_choices_each_draft_on_their_own():
    params = dict(temperature=1.0, seed=5, max_tokens=30, n=3)
    off = run(engine(NoisyRunner, spec=None)[0], [ask("n", **params)])["n"]
    on = run(engine(NoisyRunner)[0], [ask("n", **params)])["n"]
    by = lambda events: {i: [t for e in events if e.index == i for t in e.token_ids] for i in range(3)}  # noqa: E731
    assert by(on) == by(off) and all(len(v) == 30 for v in by(on).values())
    assert all(e.finish_reason is FinishReason.LENGTH for e in on if e.finished)
    assert math.isfinite(float(len(on)))


def test_a_draft_model_drafts_and_the_tokens_are_the_same():
    """--draft-model in the engine: the tiny llama's Q8_0 file drafts for its Q4_K_M file (one vocabulary), on
    fixed costs that make every draft pay; greedy and seeded answers equal speculation off's."""
    from gguf_reference import GGUF_DIR
    from servers import MODEL_CACHE

    from inference_api.config import ServerConfig
    from inference_api.engine.process import build_engine

    target, draft = str(GGUF_DIR / "llama-q4_k_m.gguf"), str(GGUF_DIR / "llama-q8_0.gguf")
    common = ["--model", target, "--rows", "2", "--context-length", "512", "--model-cache-dir", MODEL_CACHE]
    outputs = []
    for flags in (["--draft-model", draft], ["--spec-type", "off"]):
        eng, _ = build_engine(ServerConfig.from_args([*common, *flags], {}))
        eng.costs = FixedCosts(per_token=0.0001)
        reqs = [
            GenerateRequest("g", (1, 5, 9, 13), SamplingParams(temperature=0, max_tokens=40)),
            GenerateRequest("s", (1, 7, 7, 2), SamplingParams(temperature=1.0, seed=3, max_tokens=40)),
        ]
        outputs.append({k: tokens(v) for k, v in run(eng, reqs).items()})
        if flags[0] == "--draft-model":
            assert eng.drafter is not None and eng.stats.spec_accepted_tokens > 20
    assert outputs[0] == outputs[1]


def test_a_cost_measured_in_a_moment_of_load_does_not_keep_drafts_off():
    costs = StepCosts()
    costs.record(1, 0, 0.010)
    costs.record(1, 4, 0.210)  # a drafted token seemed to cost 50 ms (the machine was busy)
    sure = {0: ([5, 6, 7, 8], 0.9)}
    assert costs.choose(1, sure, 64) == {}
    for _ in range(300):  # plain steps: the cost drifts back toward its first guess
        costs.record(1, 0, 0.010)
    assert costs.choose(1, sure, 64) == {0: [5, 6, 7, 8]}
