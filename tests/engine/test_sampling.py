import torch

from inference_api.engine.messages import SamplingParams
from inference_api.engine.sampling import RowParams, apply_penalties, hash_uniform, mask_tokens, sample


def rows(n, **kw):
    base = dict(temperature=1.0, top_k=1000, top_p=1.0, seed=0, step=0)
    base.update(kw)
    return (
        torch.full((n,), float(base["temperature"])),
        torch.full((n,), base["top_k"], dtype=torch.long),
        torch.full((n,), float(base["top_p"])),
        torch.full((n,), base["seed"], dtype=torch.long),
        torch.full((n,), base["step"], dtype=torch.long),
    )


def test_greedy_rows_take_the_argmax(draw):
    logits = torch.randn(4, 50)
    t, k, p, s, st = rows(4, temperature=0.0)
    assert torch.equal(draw(logits, t, k, p, s, st), logits.argmax(-1))


def test_each_row_uses_its_own_parameters_in_one_call(draw):
    logits = torch.randn(3, 100).repeat(1, 1)
    t = torch.tensor([0.0, 1.0, 1.0])
    k = torch.tensor([100, 1, 100])  # row 1: top_k=1 is greedy too
    p = torch.tensor([1.0, 1.0, 1e-6])  # row 2: tiny top_p keeps only the best token
    s = torch.tensor([1, 2, 3])
    out = draw(logits, t, k, p, s, torch.zeros(3, dtype=torch.long))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_limits_the_choice(draw):
    logits = torch.arange(100, dtype=torch.float).repeat(200, 1)  # token 99 best
    t, k, p, _, st = rows(200, top_k=3)
    seeds = torch.arange(200)
    out = draw(logits, t, k, p, seeds, st)
    assert set(out.tolist()) == {97, 98, 99}


def test_top_p_keeps_the_nucleus(draw):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(300, 1)
    t, k, p, _, st = rows(300, top_p=0.7)
    out = draw(logits, t, k, p, torch.arange(300), st)
    assert set(out.tolist()) == {0, 1}


def test_sampling_follows_the_distribution(draw):
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000
    t, k, p, _, st = rows(n)
    out = draw(torch.log(probs).repeat(n, 1), t, k, p, torch.arange(n), st)
    freq = torch.bincount(out, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_same_seed_and_step_give_the_same_draw_whatever_the_batch(draw):
    logits = torch.randn(1, 1000)
    t, k, p, _, st = rows(1)
    alone = draw(logits, t, k, p, torch.tensor([42]), st)
    others = torch.randn(5, 1000)
    batch = torch.cat([others[:2], logits, others[2:]])
    t5, k5, p5, _, st5 = rows(6)
    seeds = torch.tensor([1, 2, 42, 3, 4, 5])
    assert draw(batch, t5, k5, p5, seeds, st5)[2] == alone[0]


def test_a_rows_draw_does_not_depend_on_the_truncation_of_the_rows_beside_it(draw):
    """Rows without top_k, top_p or min_p draw from the whole vocabulary in token order (no sort), the others from
    their sorted tokens: which way a row goes is its own, so a batch that mixes both changes no row's draw, and
    the unsorted draw still follows the distribution."""
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    t, k, p, _, st = rows(6)
    seeds = torch.arange(6) + 7
    alone = torch.cat([draw(logits[i : i + 1], t[:1], k[:1], p[:1], seeds[i : i + 1], st[:1]) for i in range(6)])
    p_mixed = torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0, 1.0])
    mixed = draw(logits, t, k, p_mixed, seeds, st)
    whole = p_mixed >= 1
    assert torch.equal(mixed[whole], alone[whole])
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 4000
    t, k, p, _, st = rows(n, top_k=3)  # top_k = the vocabulary: the unsorted draw
    out = draw(torch.log(probs).repeat(n, 1), t, k, p, torch.arange(n), st)
    assert torch.allclose(torch.bincount(out, minlength=3).float() / n, probs, atol=0.03)


def _sorted_reference(logits, top_k, top_p, seeds, steps):
    """The draw over each row's whole vocabulary sorted: top_k renormalised, the nucleus, one uniform against the
    running sums."""
    values, indices = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1])
    probs = torch.softmax(values.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf")), dim=-1)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
    sums = probs.double().cumsum(dim=-1)
    pick = torch.searchsorted(sums, hash_uniform(seeds, steps, 1) * sums[:, -1:])
    return indices.gather(1, pick).squeeze(1)


def test_a_nucleus_within_the_most_likely_tokens_draws_as_the_whole_sort_does(draw):
    """top_p without top_k sorts only the CANDIDATES most likely tokens where their mass reaches top_p (peaked rows),
    and the whole row where it does not (flat rows); top_k beyond the candidates sorts the row too. Every row draws
    the token a sort of its whole vocabulary draws."""
    torch.manual_seed(3)
    vocab, n = 5000, 300
    logits = torch.randn(n, vocab) * torch.linspace(0.5, 8.0, n)[:, None]  # flat to peaked rows
    t, k, p, _, st = rows(n, top_k=vocab, top_p=0.9)
    k[::7] = 300  # some rows with a top_k past the candidates
    seeds = torch.arange(n) * 31
    assert torch.equal(draw(logits, t, k, p, seeds, st), _sorted_reference(logits, k, p, seeds, st))


def test_hash_uniform_is_deterministic_and_in_range():
    u = hash_uniform(torch.tensor([7, 7, 8]), torch.tensor([0, 0, 0]), 1000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.05


def test_penalties():
    params = RowParams.allocate(2, 5, torch.device("cpu"))
    params.set_row(0, SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), 0, [])
    params.set_row(1, SamplingParams(repetition_penalty=2.0), 0, [3])
    params.record(torch.tensor([0, 0]), torch.tensor([2, 2]))
    logits = torch.ones(2, 5)
    out = apply_penalties(logits, torch.tensor([0, 1]), params)
    assert out[0].tolist() == [1, 1, 1 - 1.0 - 2 * 0.5, 1, 1]
    assert out[1].tolist() == [1, 1, 1, 0.5, 1]  # the prompt token is penalised


def test_penalties_change_only_each_rows_seen_tokens_as_over_the_whole_vocabulary():
    """The penalties read each row's list of seen tokens, not its whole vocabulary: the same logits as the dense
    rule (counts and a seen mask over rows x vocabulary) after prompts, repeated and fresh outputs and a row's
    reuse by another request; a row without penalties and the caller's logits unchanged."""
    torch.manual_seed(2)
    vocab, rows = 500, 4
    params = RowParams.allocate(rows, vocab, torch.device("cpu"))
    asks = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.4),
    ]
    prompts = [torch.randint(0, vocab, (40,)).tolist() for _ in range(rows)]
    for row in range(rows):
        params.set_row(row, SamplingParams(repetition_penalty=3.0), 0, list(range(200)))  # an earlier request's
        params.record(torch.tensor([row]), torch.tensor([450]))
        params.set_row(row, asks[row], 0, prompts[row])
    outputs = [[] for _ in range(rows)]
    for _ in range(30):
        picked = torch.randint(0, vocab // 4, (rows,))
        params.record(torch.arange(rows), picked)
        for row in range(rows):
            outputs[row].append(int(picked[row]))
    logits = torch.randn(rows, vocab) * 3
    before = logits.clone()
    out = apply_penalties(logits, torch.arange(rows), params)
    assert torch.equal(logits, before)
    for row, ask in enumerate(asks):
        counts = torch.bincount(torch.tensor(outputs[row]), minlength=vocab).float()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompts[row] + outputs[row])] = True
        want = before[row] - ask.frequency_penalty * counts - ask.presence_penalty * (counts > 0)
        rep = ask.repetition_penalty
        want = torch.where(seen, torch.where(want > 0, want / rep, want * rep), want)
        assert torch.allclose(out[row], want, rtol=0, atol=1e-6), row
    assert torch.equal(out[2], before[2])


def test_min_p_drops_tokens_below_a_share_of_the_best(draw):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    t, k, p, _, st = rows(400)
    assert set(draw(logits, t, k, p, torch.arange(400), st, torch.full((400,), 0.25)).tolist()) == {0, 1, 2}
    assert set(draw(logits, t, k, p, torch.arange(400), st, torch.full((400,), 0.5)).tolist()) == {0, 1}
    assert set(draw(logits, t, k, p, torch.arange(400), st, torch.zeros(400)).tolist()) == {0, 1, 2, 3}


def test_mask_tokens_only_in_each_rows_own_cells():
    logits = torch.zeros(3, 5)
    logits[:, 4], logits[:, 3] = 10.0, 5.0
    out = mask_tokens(logits, torch.tensor([[0, 4], [2, 3], [2, 4]]))  # row 0: token 4; row 2: tokens 3 and 4
    assert out.argmax(-1).tolist() == [3, 4, 0]
    assert logits[0, 4] == 10.0  # the caller's logits are untouched
    assert torch.equal(mask_tokens(logits, torch.zeros(0, 2, dtype=torch.long)), logits)


def test_the_kernels_draw_the_tokens_torch_draws(kernels):
    """The CPU's draw (the kernels' sample_rows) against torch's: the same token for every row and step, from flat to
    peaked rows of a large vocabulary, greedy and hot rows side by side, every kind of truncation; a masked token
    (a row's end token before min_tokens, a grammar's) is never drawn, even where the truncation reaches every token."""
    torch.manual_seed(5)
    vocab, n = 20000, 48
    logits = torch.randn(n, vocab) * torch.linspace(0.5, 10.0, n)[:, None]
    masked = torch.zeros(n, vocab, dtype=torch.bool)
    masked[::5, : vocab // 2] = True
    masked[7, :-1] = True  # one token left
    logits[masked] = float("-inf")
    t = torch.linspace(0.3, 1.5, n)
    t[::9] = 0.0
    seeds = torch.arange(n) * 13
    for top_k, top_p, min_p in (
        (vocab, 1.0, 0.0),
        (40, 1.0, 0.0),
        (vocab, 0.9, 0.0),
        (vocab, 0.999, 0.0),
        (vocab, 1.0, 0.05),
        (40, 0.95, 0.05),
        (1000, 0.9, 0.0),
        (vocab, 0.8, 0.2),
    ):
        k, p = torch.full((n,), top_k), torch.full((n,), top_p)
        m = torch.full((n,), min_p) if min_p else None
        for step in range(3):
            st = torch.full((n,), step)
            ours = sample(logits, t, k, p, seeds, st, m, kernels)
            assert torch.equal(ours, sample(logits, t, k, p, seeds, st, m)), (top_k, top_p, min_p, step)
            assert not masked[torch.arange(n), ours].any()
            assert ours[7] == vocab - 1
    # a min_p past 1 keeps no token: the argmax, not a fault (the APIs refuse one; the offline one may pass it)
    k, p = torch.full((n,), vocab), torch.ones(n)
    ours = sample(logits, t, k, p, seeds, torch.zeros(n, dtype=torch.long), torch.full((n,), 1.5), kernels)
    assert torch.equal(ours, logits.argmax(-1))
