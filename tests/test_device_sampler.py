"""DeviceSampler (engine/device_sampler.py) on the CPU device, against independent references:
float64 brute force (argmax, the filtered distribution, log_softmax and its top-k),
Sampler._probs bit for bit, empirical frequencies of one batched call, and reproducibility of
seeded rows alone, batched and across sampler instances."""

from __future__ import annotations

import math

import pytest
import torch

from engine.device_sampler import NON_FINITE, DeviceSampler, make_sampler, sampling_probs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

CPU = torch.device("cpu")


def make_seq(index: int = 0, **params) -> Sequence:
    return Sequence("r", index, [1, 2, 3], SamplingParams(max_tokens=8, **params), None, 0)


def probs_ref(row: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Float64 brute force of the filtered distribution (ties at the k-th kept; top-p walks the
    tokens by descending value, ties by id, and stops once the mass before reaches top_p)."""
    x = [v / temperature for v in row]
    keep = list(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [i for i in keep if x[i] >= kth]
    m = max(x[i] for i in keep)
    weight = {i: math.exp(x[i] - m) for i in keep}
    if top_p < 1:
        total, mass, kept = sum(weight.values()), 0.0, {}
        for i in sorted(keep, key=lambda i: (-x[i], i)):
            if mass >= top_p:
                break
            kept[i] = weight[i]
            mass += weight[i] / total
        weight = kept
    total = sum(weight.values())
    return [weight.get(i, 0.0) / total for i in range(len(x))]


def params_of(configs: list[tuple[float, int, float]]) -> tuple[torch.Tensor, ...]:
    temps, ks, ps = zip(*configs, strict=True)
    return (
        torch.tensor(temps, dtype=torch.float32),
        torch.tensor(ks, dtype=torch.long),
        torch.tensor(ps, dtype=torch.float32),
    )


CONFIGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.5, 0, 1.0),
    (1.7, 3, 1.0),
    (1.0, 1, 1.0),
    (0.8, 0, 0.3),
    (1.2, 0, 0.9),
    (0.9, 4, 0.7),
    (1.0, 10_000, 0.5),  # top_k past the vocabulary: off
    (2.0, 2, 0.05),  # top_p below the top token's mass: exactly one kept
]


@pytest.mark.parametrize("vocab", [5, 37, 211])
def test_probs_equal_sampler_and_brute_force(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(len(CONFIGS), vocab) * 3
    seqs = [make_seq(temperature=t, top_k=k, top_p=p) for t, k, p in CONFIGS]
    got = sampling_probs(logits, *params_of(CONFIGS))
    # Sampler's rule bit for bit, within each group; across groups Sampler may cut a top_p = 1
    # row's float-rounding tail (its cumsum reaches 1 early), which sampling_probs never does
    for group in (
        [i for i, c in enumerate(CONFIGS) if c[2] < 1],
        [i for i, c in enumerate(CONFIGS) if c[2] == 1],
    ):
        assert torch.equal(got[group], Sampler._probs(logits[group], [seqs[i] for i in group]))
    assert torch.all(got[[i for i, c in enumerate(CONFIGS) if c[1] == 0 and c[2] == 1]] > 0)
    for i, (t, k, p) in enumerate(CONFIGS):
        ref = torch.tensor(probs_ref(logits[i].tolist(), t, k, p), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), ref, atol=1e-6, rtol=1e-5)
        assert torch.equal(got[i] == 0, ref == 0)  # the same tokens dropped
        # a row alone (filters skipped where it has none) is the row batched: batch-independent
        alone = sampling_probs(
            logits[i : i + 1], *params_of([(t, k, p)]), use_top_k=0 < k < vocab, use_top_p=p < 1
        )
        assert torch.equal(alone[0], got[i])


def test_probs_with_ties_keep_the_kth_ties_and_cut_top_p_by_token_id():
    torch.manual_seed(0)
    logits = torch.randint(-2, 3, (len(CONFIGS), 23)).float()  # many exact ties
    got = sampling_probs(logits, *params_of(CONFIGS))
    for i, (t, k, p) in enumerate(CONFIGS):
        ref = torch.tensor(probs_ref(logits[i].tolist(), t, k, p), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), ref, atol=1e-6, rtol=1e-5)
        assert torch.equal(got[i] == 0, ref == 0)


def test_greedy_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(7, 41)
    logits[3, [5, 9]] = 10.0  # a tie: the first index, as argmax
    temps = [0.0, 1.0, 0.0, 0.0, 0.7, 0.0, 1e-6]
    seqs = [make_seq(temperature=t, top_k=3) for t in temps]
    results, errors = DeviceSampler(CPU).sample_isolated(logits, seqs)
    assert errors == [None] * 7
    for i, t in enumerate(temps):
        row = logits[i].double().tolist()
        best = max(range(41), key=lambda v: (row[v], -v))
        if t < 1e-5:
            assert results[i].token_id == best
        assert results[i].logprob is None and results[i].top_logprobs is None


def test_empirical_frequencies_of_one_batched_call():
    torch.manual_seed(2)
    vocab, n = 12, 6000
    configs = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 4, 0.8)]
    base = torch.randn(len(configs), vocab) * 1.5
    logits = base.repeat_interleave(n, dim=0)  # [4n, V]: config c in rows [c n, (c + 1) n)
    seqs = [make_seq(temperature=t, top_k=k, top_p=p) for t, k, p in configs for _ in range(n)]
    results, errors = DeviceSampler(CPU, seed=5).sample_isolated(logits, seqs)
    assert errors == [None] * len(seqs)
    ids = torch.tensor([r.token_id for r in results]).view(len(configs), n)
    for c, (t, k, p) in enumerate(configs):
        target = torch.tensor(probs_ref(base[c].tolist(), t, k, p), dtype=torch.float64)
        freq = torch.bincount(ids[c], minlength=vocab).double() / n
        assert torch.all(freq[target == 0] == 0), (c, freq, target)  # a dropped token never drawn
        bound = 4.5 * (target * (1 - target) / n).sqrt() + 1e-3
        assert torch.all((freq - target).abs() <= bound), (c, freq, target)


def _run_steps(sampler: DeviceSampler, batch: list[Sequence], steps: torch.Tensor) -> dict:
    """steps: [num_steps, num_rows, V], row r for the sequence batch[r]; seq_id -> its tokens."""
    out: dict[int, list[int]] = {s.seq_id: [] for s in batch}
    for logits in steps:
        results, errors = sampler.sample_isolated(logits, batch)
        assert errors == [None] * len(batch)
        for s, r in zip(batch, results, strict=True):
            out[s.seq_id].append(r.token_id)
    return out


SEEDED = [  # (index, params): a request's two completions, a huge seed, filters
    (0, dict(temperature=0.9, top_k=20, seed=1234)),
    (1, dict(temperature=0.9, top_k=20, seed=1234)),
    (0, dict(temperature=1.0, seed=2**63 - 1)),
    (0, dict(temperature=1.1, top_p=0.8, seed=-(2**63))),
]
OTHERS = [dict(temperature=1.0, top_p=0.5), dict(temperature=0.0), dict(temperature=0.7, top_k=3)]


def test_seeded_rows_same_alone_batched_and_across_samplers():
    torch.manual_seed(3)
    num_steps, vocab = 6, 50
    seeded_logits = torch.randn(num_steps, len(SEEDED), vocab)
    other_logits = torch.randn(num_steps, len(OTHERS), vocab)
    alone = []
    for j, (index, params) in enumerate(SEEDED):
        seq = make_seq(index, **params)
        got = _run_steps(DeviceSampler(CPU, seed=0), [seq], seeded_logits[:, j : j + 1])
        alone.append(got[seq.seq_id])
    assert alone[0] != alone[1]  # the two completions of one request draw apart
    assert all(len(set(t)) > 1 for t in alone)  # the draws are random, not stuck

    for sampler_seed in (0, 99):  # another instance, another seed for the unseeded rows
        seeded = [make_seq(index, **params) for index, params in SEEDED]
        others = [make_seq(**params) for params in OTHERS]
        batch = [others[0], seeded[2], seeded[0], others[1], seeded[3], others[2], seeded[1]]
        rows = [("o", 0), ("s", 2), ("s", 0), ("o", 1), ("s", 3), ("o", 2), ("s", 1)]
        steps = torch.stack(
            [(seeded_logits if kind == "s" else other_logits)[:, j] for kind, j in rows],
            dim=1,
        )
        got = _run_steps(DeviceSampler(CPU, seed=sampler_seed), batch, steps)
        assert [got[s.seq_id] for s in seeded] == alone


def test_free_restarts_a_seeded_sequence():
    torch.manual_seed(4)
    logits = torch.randn(5, 1, 64)
    sampler = DeviceSampler(CPU)
    seq = make_seq(temperature=1.0, seed=77)
    first = _run_steps(sampler, [seq], logits)[seq.seq_id]
    again = _run_steps(sampler, [seq], logits)[seq.seq_id]
    sampler.free(seq.seq_id)
    restarted = _run_steps(sampler, [seq], logits)[seq.seq_id]
    assert again != first and restarted == first
    sampler.free(12345)  # unknown: fine


def test_logprobs_are_log_softmax_and_its_top_k():
    torch.manual_seed(5)
    vocab = 40
    wants = [None, 0, 3, 7, 20, 5]
    temps = [1.0, 0.0, 0.8, 0.0, 1.2, 1.0]
    seqs = [make_seq(temperature=t, logprobs=k, seed=9) for t, k in zip(temps, wants, strict=True)]
    logits = torch.randn(len(seqs), vocab) * 2
    results, errors = DeviceSampler(CPU).sample_isolated(logits, seqs)
    assert errors == [None] * len(seqs)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, k in enumerate(wants):
        r = results[i]
        if k is None:
            assert r.logprob is None and r.top_logprobs is None
            continue
        assert r.logprob == pytest.approx(ref[i, r.token_id].item(), abs=1e-5)
        top = set(ref[i].topk(k).indices.tolist()) if k else set()
        assert set(r.top_logprobs) == top | {r.token_id}
        for t, lp in r.top_logprobs.items():
            assert lp == pytest.approx(ref[i, t].item(), abs=1e-5)


def _bad_row_batch(bad_value) -> tuple[list[Sequence], list[int]]:
    seqs = [
        make_seq(temperature=0.0),
        make_seq(temperature=0.9, seed=7),
        make_seq(temperature=1.0),
        make_seq(1, temperature=0.7, seed=3),  # made bad below
        make_seq(temperature=0.8, top_p=0.9, seed=11),
    ]
    seqs[3].params.temperature = bad_value  # changed after verify, as a careless caller might
    return seqs, [0, 1, 4]


@pytest.mark.parametrize(
    "bad,reason",
    [
        (math.nan, NON_FINITE),  # flagged on the device
        ("hot", "TypeError: temperature"),  # refused on the host
        (10**400, "OverflowError"),  # raises in the batch: the rows rerun one by one
    ],
)
def test_a_bad_row_fails_alone(bad, reason):
    torch.manual_seed(6)
    steps = torch.randn(3, 5, 30)
    good, keep = _bad_row_batch(1.0)
    want = _run_steps(DeviceSampler(CPU), [good[i] for i in keep], steps[:, keep])
    want = [want[good[i].seq_id] for i in keep]
    seqs, _ = _bad_row_batch(bad)
    sampler = DeviceSampler(CPU)
    got: list[list[int]] = [[] for _ in keep]
    for logits in steps:
        results, errors = sampler.sample_isolated(logits, seqs)
        assert results[3] is None and errors[3].startswith(reason), errors[3]
        assert errors[2] is None and results[2] is not None
        for j, i in enumerate(keep):
            assert errors[i] is None
            got[j].append(results[i].token_id)
    assert got == want


class FakeGrammars:
    """StructuredOutputManager's contract: apply_bitmask(logits [S, V] float32 CPU, seqs) sets
    disallowed logits to -inf in place and returns an error per row; accept(seq, token)."""

    def __init__(self, allowed: dict[int, set[int]], broken=(), refuse=()) -> None:
        self.allowed, self.broken, self.refuse = allowed, set(broken), set(refuse)
        self.accepted: list[tuple[int, int]] = []

    def apply_bitmask(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[str | None]:
        assert logits.device.type == "cpu" and logits.dtype == torch.float32
        errors: list[str | None] = []
        for i, s in enumerate(seqs):
            if s.seq_id in self.broken:
                errors.append("GrammarError: broken matcher")
                continue
            if s.seq_id in self.allowed:
                mask = torch.ones(logits.shape[1], dtype=torch.bool)
                mask[sorted(self.allowed[s.seq_id])] = False
                logits[i, mask] = -math.inf
            errors.append(None)
        return errors

    def accept(self, seq: Sequence, token_id: int) -> str | None:
        if seq.seq_id not in self.allowed:
            return None
        self.accepted.append((seq.seq_id, token_id))
        if seq.seq_id in self.refuse or token_id not in self.allowed[seq.seq_id]:
            return "GrammarError: refused"
        return None


def test_structured_mask_restricts_the_draw():
    torch.manual_seed(7)
    vocab, n = 32, 300
    so = {"regex": "[a-c]"}
    allowed = {3, 7, 11}
    constrained = [make_seq(temperature=1.0, structured_outputs=so) for _ in range(n)]
    greedy = make_seq(temperature=0.0, structured_outputs=so, logprobs=4)
    free = make_seq(temperature=1.0, logprobs=2)
    broken = make_seq(temperature=1.0, structured_outputs=so)
    refused = make_seq(temperature=1.0, structured_outputs=so)
    seqs = [*constrained, greedy, free, broken, refused]
    grammars = FakeGrammars(
        {s.seq_id: allowed for s in [*constrained, greedy, broken, refused]},
        broken=[broken.seq_id],
        refuse=[refused.seq_id],
    )
    logits = torch.randn(len(seqs), vocab)
    logits[:, 0] = 8.0  # the favourite token is disallowed
    sampler = DeviceSampler(CPU)
    sampler.structured = grammars
    results, errors = sampler.sample_isolated(logits, seqs)
    drawn = {r.token_id for r in results[:n]}
    assert drawn == allowed  # only the allowed ones, and each of them
    row = logits[n].double()
    assert results[n].token_id == max(allowed, key=lambda t: row[t].item())
    masked = torch.full_like(row, -math.inf)
    masked[sorted(allowed)] = row[sorted(allowed)]
    ref = torch.log_softmax(masked, dim=-1)  # the masked distribution's logprobs
    top = results[n].top_logprobs  # top 4 of 3 allowed: one disallowed at -inf, as Sampler
    assert len(top) == 4 and allowed <= set(top)
    for t, lp in top.items():
        assert lp == pytest.approx(ref[t].item(), abs=1e-5) if t in allowed else lp == -math.inf
    assert results[n + 1].token_id == 0  # unconstrained: unmasked
    assert results[n + 1].logprob == pytest.approx(
        torch.log_softmax(logits[n + 1].double(), -1)[0].item(), abs=1e-5
    )
    assert results[n + 2] is None and errors[n + 2] == "GrammarError: broken matcher"
    assert results[n + 3] is None and errors[n + 3] == "GrammarError: refused"
    assert errors[: n + 2] == [None] * (n + 2)
    accepted = [sid for sid, _ in grammars.accepted]  # once per sampled constrained row
    assert sorted(accepted) == sorted(s.seq_id for s in [*constrained, greedy, refused])


def test_make_sampler_picks_by_device():
    assert type(make_sampler("cpu", 3)) is Sampler
    if torch.cuda.is_available():
        assert isinstance(make_sampler("cuda", 3), DeviceSampler)


def test_logits_on_another_device_are_refused():
    with pytest.raises(ValueError, match="sampler on"):
        DeviceSampler(CPU).sample_isolated(torch.zeros(1, 4, device="meta"), [make_seq()])
