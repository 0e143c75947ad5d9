"""Engine.step() over the mock runner (no weights, no sleeping): scheduling, chunked prefill, release."""

from __future__ import annotations

from collections import defaultdict

import pytest

from inference_api.engine.engine import Engine
from inference_api.engine.messages import FinishReason, GenerateRequest, SamplingParams
from inference_api.mock.runner import MockRunner
from inference_api.mock.tokenizer import EOS, ByteTokenizer


class SpyRunner(MockRunner):
    """The mock runner, recording what each forward was given."""

    def __init__(self, rows: int):
        super().__init__(rows, tokens_per_second=0)
        self.prefills: list[list[int]] = []  # per prefill call: the chunk lengths
        self.copies: list[tuple[int, int, int]] = []  # per prefix copy: (src, dst, length)
        self.fail_decode = False

    def prefill(self, rows, chunks, starts):
        self.prefills.append([len(c) for c in chunks])
        return super().prefill(rows, chunks, starts)

    def decode(self, rows, tokens, positions):
        if self.fail_decode:
            raise RuntimeError("device lost")
        return super().decode(rows, tokens, positions)

    def copy_prefix(self, src, dst, length):
        self.copies.append((src, dst, length))
        super().copy_prefix(src, dst, length)


def make_engine(
    rows: int = 4, prefill_chunk: int = 64, context: int = 4096, prefix_cache: bool = True
) -> tuple[Engine, SpyRunner]:
    runner = SpyRunner(rows)
    engine = Engine(runner, ByteTokenizer(), rows, context, prefill_chunk, frozenset([EOS]), prefix_cache=prefix_cache)
    return engine, runner


def request(sid: str, prompt: str, max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(sid, tuple(prompt.encode()), SamplingParams(temperature=0, max_tokens=max_tokens))


def run(engine: Engine, limit: int = 1000) -> dict[str, list]:
    events = defaultdict(list)
    for _ in range(limit):
        if not engine.has_work:
            return events
        for event in engine.step():
            events[event.session_id].append(event)
    raise AssertionError("engine did not finish")


def text(events) -> str:
    return "".join(e.text for e in events)


def test_more_requests_than_rows_all_finish_with_their_own_text_and_free_everything():
    engine, _ = make_engine(rows=4)
    prompts = {f"s{i}": f"prompt number {i}" for i in range(10)}
    for sid, prompt in prompts.items():
        engine.add(request(sid, prompt, max_tokens=20))
    assert engine.stats.rows_in_use == 0 and engine.stats.waiting == 10
    first = engine.step()
    assert engine.stats.rows_in_use == 4 and engine.stats.waiting == 6
    events = run(engine)
    for event in first:
        events[event.session_id].insert(0, event)
    for sid, prompt in prompts.items():
        assert text(events[sid]) == ("Echo: " + prompt)[:20]  # the mock echoes its own row's prompt
        assert events[sid][-1].finish_reason is FinishReason.LENGTH
        assert events[sid][-1].completion_tokens == 20 and events[sid][-1].prompt_tokens == len(prompt)
    assert engine.stats.rows_in_use == 0 and not engine.sessions and not engine.scheduler.running


def test_long_prompt_is_prefilled_in_bounded_chunks_while_other_rows_keep_decoding():
    engine, runner = make_engine(rows=4, prefill_chunk=64)
    engine.add(request("short", "hi", max_tokens=100))
    engine.step()  # "short" is prefilled and decoding
    engine.add(request("long", "x" * 300, max_tokens=4))
    short_tokens = 0
    while engine.sessions["long"][0].num_output == 0:
        events = engine.step()
        short_tokens += sum(len(e.token_ids) for e in events if e.session_id == "short")
    assert all(sum(chunk) <= 64 for chunk in runner.prefills)
    assert sum(runner.prefills[-1]) > 0 and len(runner.prefills) == 1 + 5  # 300 tokens: 5 chunks of at most 64
    assert short_tokens == 5  # one token for the running row in every step of the long prefill


def test_several_short_prompts_share_one_prefill_within_the_budget():
    engine, runner = make_engine(rows=4, prefill_chunk=64)
    for i in range(4):
        engine.add(request(f"s{i}", "y" * 15))
    engine.step()
    assert runner.prefills == [[15, 15, 15, 15]]


def test_cancel_frees_a_running_row_and_removes_a_waiting_request():
    engine, _ = make_engine(rows=1)
    engine.add(request("running", "a", max_tokens=50))
    engine.add(request("waiting", "b", max_tokens=50))
    engine.step()
    assert engine.stats.rows_in_use == 1 and engine.stats.waiting == 1
    engine.cancel("waiting")
    assert engine.stats.waiting == 0 and "waiting" not in engine.sessions
    engine.cancel("running")
    assert engine.stats.rows_in_use == 0 and not engine.sessions and not engine.has_work
    engine.cancel("unknown")  # a late cancel for a finished session is harmless


def test_a_failed_forward_ends_running_requests_with_an_error_and_the_engine_keeps_serving(caplog):
    """The clients get a generic error; the exception's text (paths, shapes, internals) goes to the log only."""
    from inference_api.engine.engine import ENGINE_ERROR

    engine, runner = make_engine(rows=2)
    engine.add(request("a", "one", max_tokens=50))
    engine.add(request("b", "two", max_tokens=50))
    engine.step()
    runner.fail_decode = True
    with caplog.at_level("ERROR"):
        events = engine.step()
    assert {e.session_id for e in events} == {"a", "b"}
    assert all(e.finish_reason is FinishReason.ERROR and e.error == ENGINE_ERROR for e in events)
    assert "device lost" in caplog.text and all("device lost" not in e.error for e in events)
    assert engine.stats.rows_in_use == 0 and not engine.sessions
    runner.fail_decode = False
    engine.add(request("c", "three", max_tokens=5))
    assert text(run(engine)["c"]) == "Echo:"


@pytest.mark.parametrize("stop, expected", [(("mber",), "Echo: nu"), (("zzz",), "Echo: number")])
def test_stop_sequences_cut_the_stream(stop, expected):
    engine, _ = make_engine()
    engine.add(GenerateRequest("s", tuple(b"number"), SamplingParams(temperature=0, max_tokens=12, stop=stop)))
    events = run(engine)["s"]
    assert text(events) == expected
    assert events[-1].finish_reason is (FinishReason.STOP if stop == ("mber",) else FinishReason.LENGTH)


class EagerEndRunner(SpyRunner):
    """A model that always wants to end: the end token has the highest logit at every step."""

    def _logits(self, rows, next_positions):
        logits = super()._logits(rows, next_positions)
        logits[:, EOS] = 100.0
        return logits


def test_min_tokens_hold_the_end_token_off_and_ignore_eos_runs_to_max_tokens():
    runner = EagerEndRunner(2)
    engine = Engine(runner, ByteTokenizer(), 2, 4096, 64, frozenset([EOS]))
    engine.add(GenerateRequest("plain", tuple(b"abc"), SamplingParams(temperature=0, max_tokens=10)))
    engine.add(GenerateRequest("min", tuple(b"abc"), SamplingParams(temperature=0, max_tokens=10, min_tokens=5)))
    events = run(engine)
    assert events["plain"][-1].finish_reason is FinishReason.EOS and events["plain"][-1].completion_tokens == 1
    assert text(events["min"]) == "Echo:" and events["min"][-1].finish_reason is FinishReason.EOS
    assert events["min"][-1].completion_tokens == 6
    engine.add(GenerateRequest("all", tuple(b"abc"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert run(engine)["all"][-1].finish_reason is FinishReason.LENGTH


def test_stop_token_ids_end_the_output_without_showing_the_token():
    engine, _ = make_engine()
    engine.add(
        GenerateRequest("s", tuple(b"number"), SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(ord("o"),)))
    )
    engine.add(
        GenerateRequest(
            "m",
            tuple(b"number"),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=4, stop_token_ids=(ord("o"),)),
        )
    )
    events = run(engine)
    assert text(events["s"]) == "Ech" and events["s"][-1].finish_reason is FinishReason.STOP
    assert events["s"][-1].completion_tokens == 4
    # before min_tokens the stop token is masked: the mock's next-best logit is 0 for every token (byte 0)
    assert events["m"][-1].completion_tokens > 4


def test_another_requests_min_tokens_never_masks_this_rows_tokens():
    """A victim's greedy answer, alone and beside a request whose min_tokens masks every id but one: each row
    masks only its own end and stop tokens, so the victim's answer does not change."""
    alone, _ = make_engine()
    alone.add(GenerateRequest("victim", tuple(b"hi"), SamplingParams(temperature=0, max_tokens=10, min_tokens=10)))
    want = text(run(alone)["victim"])
    engine, _ = make_engine()
    everything_but_x = tuple(t for t in range(256) if t != ord("X"))
    engine.add(
        GenerateRequest(
            "hostile",
            tuple(b"ho"),
            SamplingParams(temperature=0, max_tokens=40, min_tokens=40, stop_token_ids=everything_but_x),
        )
    )
    engine.add(GenerateRequest("victim", tuple(b"hi"), SamplingParams(temperature=0, max_tokens=10, min_tokens=10)))
    events = run(engine)
    assert text(events["victim"]) == want and "X" not in want
    assert set(text(events["hostile"])) == {"X"}  # the hostile row itself gets only what it left open


@pytest.mark.parametrize("trial", range(12))
def test_random_parameter_mixes_beside_a_victim_never_change_its_answer(trial):
    """Brute force over the per-row parameters: three requests with random mixes (hot seeded or unseeded
    sampling, top-k/top-p/min-p, penalties, log-probs, min_tokens with random stop ids, stop strings, ignore_eos,
    n choices forked through the prefix cache, prompt log-probs) in the same steps as a victim; every victim
    (greedy, or seeded hot sampling) answers as it does alone."""
    import random

    rng = random.Random(trial)

    def params(victim: bool) -> SamplingParams:
        if victim:
            hot = rng.random() < 0.5
            return SamplingParams(
                temperature=0.9 if hot else 0,
                seed=rng.randrange(1 << 30) if hot else None,
                max_tokens=12,
                min_tokens=rng.choice([0, 6]),
            )
        return SamplingParams(
            temperature=rng.choice([0, 0.5, 1.5, 3.0]),
            top_k=rng.choice([0, 1, 5, 50]),
            top_p=rng.choice([1.0, 0.5]),
            min_p=rng.choice([0.0, 0.2]),
            max_tokens=rng.randrange(1, 30),
            min_tokens=rng.choice([0, 10, 40]),
            stop=tuple(rng.sample(["E", "o", ": ", "x"], rng.randrange(0, 3))),
            stop_token_ids=tuple(rng.sample(range(256), rng.choice([0, 5, 200]))),
            seed=rng.choice([None, rng.randrange(1 << 30)]),
            presence_penalty=rng.choice([0.0, 2.0, -2.0]),
            frequency_penalty=rng.choice([0.0, 1.5]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.7]),
            logprobs=rng.choice([None, 0, 5]),
            ignore_eos=rng.random() < 0.3,
            n=rng.choice([1, 1, 2, 3]),
            prompt_logprobs=rng.choice([None, None, 0, 3]),
        )

    victim = GenerateRequest("victim", tuple(b"abc"), params(True))
    alone, _ = make_engine()
    alone.add(victim)
    want = text(run(alone)["victim"])
    crowd, _ = make_engine()
    for i in range(3):
        crowd.add(GenerateRequest(f"h{i}", tuple(rng.choice([b"abc", b"ab", b"hello", b"x" * 70])), params(False)))
    crowd.add(victim)
    assert text(run(crowd)["victim"]) == want


def test_a_repeated_prompt_computes_only_its_last_token_in_the_row_that_still_holds_it():
    engine, runner = make_engine(rows=4)
    prompt = "the same question, asked twice"
    engine.add(request("first", prompt, max_tokens=10))
    first = text(run(engine)["first"])
    engine.add(request("again", prompt, max_tokens=10))
    assert text(run(engine)["again"]) == first == ("Echo: " + prompt)[:10]
    assert runner.prefills == [[len(prompt)], [1]] and runner.copies == []  # row 0 both times: nothing to copy
    stats = engine.stats  # every prompt token is looked up; all but the last are found the second time
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (2 * len(prompt), len(prompt) - 1)


def test_a_shared_prefix_is_copied_from_a_busy_row_and_each_stream_keeps_its_own_text():
    engine, runner = make_engine(rows=4)
    system = "You are a helpful assistant. Answer briefly. "
    engine.add(request("a", system + "Question A?", max_tokens=60))
    engine.step()  # "a" is prefilled in row 0 and decoding
    engine.add(request("b", system + "What about B?", max_tokens=60))
    events = run(engine)
    assert runner.copies == [(0, 1, len(system))] and engine.stats.prefix_hit_tokens == len(system)
    assert runner.prefills[-1] == [len("What about B?")]
    assert text(events["b"]) == ("Echo: " + system + "What about B?")[:60]
    assert engine.stats.rows_in_use == 0


def test_the_next_chat_turn_reuses_the_previous_answer_too():
    engine, runner = make_engine(rows=2)
    engine.add(request("turn1", "hi", max_tokens=8))
    answer = run(engine)["turn1"]
    answered = list(b"hi") + [t for e in answer for t in e.token_ids]
    turn2 = answered + list(b" and then?")
    engine.add(GenerateRequest("turn2", tuple(turn2), SamplingParams(temperature=0, max_tokens=4)))
    run(engine)
    # the row holds the prompt and every answer token but the last (sampled, never fed back)
    assert runner.prefills[-1] == [len(turn2) - (len(answered) - 1)]


def test_without_the_prefix_cache_or_after_a_failed_forward_prompts_are_computed_in_full():
    engine, runner = make_engine(rows=2, prefix_cache=False)
    for sid in ("one", "two"):
        engine.add(request(sid, "same prompt", max_tokens=3))
        run(engine)
    assert runner.prefills == [[11], [11]]
    assert engine.stats.prefix_queried_tokens == engine.stats.prefix_hit_tokens == 0  # no cache, no look-up
    engine, runner = make_engine(rows=2)
    engine.add(request("lost", "same prompt", max_tokens=30))
    engine.step()
    runner.fail_decode = True
    engine.step()
    runner.fail_decode = False
    engine.add(request("after", "same prompt", max_tokens=3))
    assert text(run(engine)["after"]) == "Ech" and runner.prefills[-1] == [11]


def test_stats_count_the_cache_positions_the_rows_in_use_hold():
    engine, _ = make_engine(rows=2, context=64)
    assert (engine.stats.kv_tokens_in_use, engine.stats.kv_tokens_total) == (0, 2 * 64)
    engine.add(request("a", "hello", max_tokens=4))
    engine.add(request("b", "hi", max_tokens=50))
    engine.step()  # both prompts are written; their first tokens are sampled, not written yet
    assert engine.stats.kv_tokens_in_use == 5 + 2
    engine.step()
    assert engine.stats.kv_tokens_in_use == 6 + 3
    run(engine)
    assert engine.stats.kv_tokens_in_use == 0 and engine.stats.rows_in_use == 0  # freed rows hold no live positions


class CopyFailsRunner(SpyRunner):
    def copy_prefix(self, src, dst, length):
        raise RuntimeError("copy failed")


def test_a_prefix_that_could_not_be_copied_is_not_counted_as_a_hit():
    runner = CopyFailsRunner(2)
    engine = Engine(runner, ByteTokenizer(), 2, 4096, 64, frozenset([EOS]))
    engine.add(request("a", "shared prefix, then a", max_tokens=30))
    engine.step()  # "a" decodes in row 0
    engine.add(request("b", "shared prefix, then b", max_tokens=3))
    engine.step()  # "b" would copy row 0's prefix into row 1: the copy fails and its prompt is computed in full
    assert runner.prefills[-1] == [len("shared prefix, then b")]
    stats = engine.stats
    assert (stats.prefix_queried_tokens, stats.prefix_hit_tokens) == (2 * len("shared prefix, then a"), 0)


def choices(events) -> dict[int, list]:
    out = defaultdict(list)
    for e in events:
        out[e.index].append(e)
    return out


def test_n_choices_fork_from_one_prefill_each_in_its_own_row():
    """Choice 0 computes the prompt; the other choices wait until it is cached, then copy it from choice 0's row
    and compute only the last prompt token (whose logits give their first token)."""
    engine, runner = make_engine(rows=4)
    prompt = "a prompt of some length"
    engine.add(GenerateRequest("s", tuple(prompt.encode()), SamplingParams(temperature=0, max_tokens=6, n=3)))
    by_choice = choices(run(engine)["s"])
    assert runner.prefills[0] == [len(prompt)] and runner.prefills[1] == [1, 1]  # one full prefill, then 1 each
    assert sorted(runner.copies) == [(0, 1, len(prompt) - 1), (0, 2, len(prompt) - 1)]
    assert sorted(by_choice) == [0, 1, 2]
    for events in by_choice.values():  # greedy: n equal choices, each finished once
        assert text(events) == ("Echo: " + prompt)[:6] and [e.finished for e in events].count(True) == 1
    assert by_choice[1][-1].cached_tokens == len(prompt) - 1 and by_choice[0][-1].cached_tokens == 0
    assert engine.stats.prefix_hit_tokens == 2 * (len(prompt) - 1)
    assert not engine.sessions and not engine.scheduler.running and not engine.has_work


def test_seeded_choices_are_reproducible_and_differ():
    from inference_api.engine.sampling import choice_seed

    assert choice_seed(7, 0) == 7 and len({choice_seed(7, i) for i in range(8)}) == 8
    assert all(0 <= choice_seed(s, i) < 1 << 63 for s in (0, -5, 1 << 62) for i in range(1, 4))

    def seeds(n: int) -> list[int]:
        engine, _ = make_engine(rows=4)
        engine.add(GenerateRequest("s", tuple(b"seeded"), SamplingParams(seed=11, max_tokens=2, n=n)))
        run(engine)
        return engine.sampler.params.seed[:n].tolist()

    assert seeds(3) == [choice_seed(11, i) for i in range(3)] and seeds(1) == [11]


def test_cancel_ends_every_choice_held_waiting_or_running():
    engine, _ = make_engine(rows=2)
    engine.add(GenerateRequest("s", tuple(b"abc"), SamplingParams(temperature=0, max_tokens=50, n=4)))
    engine.step()  # choice 0 prefilled; 1..3 queued, two of them will wait for rows
    engine.step()
    assert engine.stats.rows_in_use == 2 and engine.stats.waiting == 2
    engine.cancel("s")
    assert engine.stats.rows_in_use == 0 and engine.stats.waiting == 0 and not engine.sessions
    assert not engine.has_work
    engine.add(GenerateRequest("t", tuple(b"abc"), SamplingParams(temperature=0, max_tokens=50, n=3)))
    engine.cancel("t")  # before any step: choice 0 waiting, the others held
    assert not engine.sessions and not engine.has_work


def test_prompt_logprobs_come_with_the_first_event_and_reuse_no_prefix():
    engine, runner = make_engine(rows=2, prefill_chunk=8)
    engine.add(request("warm", "the prompt here"))
    run(engine)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, n=2)
    engine.add(GenerateRequest("s", tuple(b"the prompt here"), params))
    events = run(engine)["s"]
    first = [e for e in events if e.index == 0][0]
    lps = first.prompt_logprobs
    assert len(lps) == 15 and lps[0] is None and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in lps[1:])
    assert [lp.token for lp in lps[1:]] == list("he prompt here")
    assert first.cached_tokens == 0  # computed in full (in chunks of 8), though the row held it
    assert all(e.prompt_logprobs is None for e in events if e is not first)


def test_a_grammar_that_fails_in_a_step_without_sampled_rows_still_reports_its_error():
    """The mock engine has no grammar support: the request fails as its matcher would; the step only prefills a
    chunk of a long prompt (no row samples), and the error event must still go out."""
    from inference_api.engine.grammar import Grammar

    engine, _ = make_engine(rows=4, prefill_chunk=8)
    engine.add(request("long", "x" * 40))
    engine.add(GenerateRequest("g", tuple(b"json"), SamplingParams(grammar=Grammar("regex", "a+"), n=2)))
    events = engine.step()
    assert [(e.session_id, e.finish_reason) for e in events] == [("g", FinishReason.ERROR)]
    assert "g" not in engine.sessions


@pytest.mark.parametrize(
    ("needs", "budget", "chunks"),
    [
        ([300], 64, [64]),  # alone: the whole chunk
        ([15, 15, 15, 15], 64, [15, 15, 15, 15]),  # all fit with their padding
        ([1000, 5], 512, [256, 5]),  # a short prompt beside a long one: done in this step
        ([5, 1000, 1000], 512, [5, 170, 170]),  # three share: each up to a third
        ([1000] * 20, 512, [25] * 20),
        ([1000] * 80, 512, [8] * 64),  # at least MIN_SHARE each: the first 64 in arrival order
        ([], 512, []),
    ],
)
def test_fair_chunks_share_the_budget_in_arrival_order(needs, budget, chunks):
    from inference_api.engine.scheduler import fair_chunks

    assert fair_chunks(needs, budget) == chunks
    assert len(chunks) * max(chunks, default=0) <= budget or len(chunks) == 1


def test_a_short_prompt_gets_its_first_token_in_its_first_step_beside_long_prompts():
    """Long prompts that arrived first (and hold the lower rows) never keep a later short one waiting: it shares
    the next step's chunk and samples its first token there, while the decoding row keeps decoding."""
    engine, runner = make_engine(rows=4, prefill_chunk=64)
    engine.add(request("decoding", "hi", max_tokens=200))
    engine.step()
    engine.add(request("long-1", "x" * 600, max_tokens=2))
    engine.add(request("long-2", "z" * 600, max_tokens=2))
    engine.step()  # both long prompts start
    engine.add(request("short", "a question", max_tokens=2))
    events = engine.step()
    assert [e.session_id for e in events if e.session_id != "decoding" and e.token_ids] == ["short"]
    assert any(e.session_id == "decoding" for e in events)  # decode rows are never skipped for prompts
    assert all(len(p) * max(p) <= 64 for p in runner.prefills)


def test_the_prefix_cache_is_private_to_a_team_and_a_cache_salt():
    """While team A's request holds its prompt in a row, another team's prompt (or the same team's with another
    cache_salt, or one without a team) never reuses it: it is computed in full; the same team and salt does."""
    prompt = tuple(b"My SSN is 987-65-4321, keep it secret.")

    def send(sid: str, team: str | None, salt: str | None = None, max_tokens: int = 3) -> int:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=salt)
        engine.add(GenerateRequest(sid, prompt, params, team=team))
        for _ in range(100):
            for event in engine.step():
                if event.session_id == sid:
                    return event.cached_tokens
        raise AssertionError(f"{sid} got no event")

    engine, runner = make_engine(rows=8)
    assert send("a1", "team-a", max_tokens=500) == 0  # holds row 0 while the others come
    for sid, team, salt in [("b", "team-b", None), ("none", None, None), ("salted", "team-a", "x")]:
        assert send(sid, team, salt) == 0
    assert runner.copies == []
    assert send("a2", "team-a") == len(prompt) - 1  # the last prompt token is always computed
    assert [(src, n) for src, _, n in runner.copies] == [(0, len(prompt) - 1)]  # from team A's busy row


def test_short_prompts_step_alone_every_other_step_at_most_so_long_prompts_go_on():
    """A short prompt arriving beside a long one has a step to itself (its first token after one small step); a
    new short prompt every step never holds the long one back for two steps in a row."""
    engine, runner = make_engine(rows=8, prefill_chunk=64)  # short: at most 64 // 8 = 8 tokens left
    engine.add(request("long", "x" * 300, max_tokens=1))
    engine.step()
    for i in range(6):
        engine.add(request(f"short-{i}", "ab", max_tokens=1))
        engine.step()
    steps = [[n for n in chunks if n > 8] for chunks in runner.prefills]  # the long prompt's chunk, if any
    assert runner.prefills[1] == [2]  # the first short prompt alone
    assert all(steps[i] or steps[i + 1] for i in range(len(steps) - 1)), runner.prefills
