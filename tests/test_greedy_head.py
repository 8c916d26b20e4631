"""The greedy lm_head (raylora_kernels/csrc/head_cpu.cpp, packed_weight.GreedyHead): its ids are
argmax over the packed GEMM's float32 logits, bit for bit, the reference here, on near-ties
built to defeat a bfloat16 screen, exact ties, ragged panels, non-finite rows; and the engine
gives the same tokens with it and without it."""

from __future__ import annotations

import pytest
import torch

from raylora_kernels import cpu_kernel
from raylora_kernels.packed_weight import PANEL, GreedyHead, PackedWeight

pytestmark = pytest.mark.timeout(240)


def _head(weight: torch.Tensor) -> tuple[GreedyHead, PackedWeight]:
    op = cpu_kernel.cpu_greedy_head_op()
    if op is None:
        pytest.skip("no greedy head: the C++ kernels lack AVX512-BF16 here (or are off)")
    pw = PackedWeight.pack(weight)
    head = GreedyHead.build(pw, op)
    assert head is not None
    return head, pw


def _reference(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """torch.argmax over linear_packed's float32 logits: what the sampler picks without it."""
    logits = cpu_kernel.cpu_linear_packed_op()(x, pw.data, pw.out_features, None)
    return logits.argmax(dim=-1)


def _check(head: GreedyHead, pw: PackedWeight, x: torch.Tensor) -> None:
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(head(x), _reference(x, pw))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 33, 70])
@pytest.mark.parametrize("vocab,hidden", [(1, 2), (47, 64), (960, 576), (1000, 96)])
def test_random_rows_match_the_float32_argmax(rows, vocab, hidden):
    """Every tile remainder, a ragged last panel (its zero padding is never picked, even when
    every real logit is negative), x a view with a row stride past its width."""
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    weight = torch.randn(vocab, hidden, generator=gen) - 0.3  # many all-negative rows
    x = torch.randn(rows, hidden + 2, generator=gen)[:, :hidden] * 3
    head, pw = _head(weight)
    _check(head, pw, x)


def test_near_ties_a_bfloat16_screen_cannot_separate():
    """Columns that differ from one another by less than bfloat16 can tell (relative 1e-5 to
    1e-7 perturbations of one row), so the screen's values order them at random: only the
    exact recheck of every candidate panel gives the float32 argmax. Columns spread over many
    panels, and exact duplicates (a tie: the first index wins)."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 576, 48 * 40
    base = torch.randn(hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.2
    near = torch.arange(0, vocab, 7)  # every 7th column: a near-copy of base
    for scale in (1e-5, 1e-6, 1e-7):
        w = weight.clone()
        w[near] = base + scale * torch.randn(len(near), hidden, generator=gen)
        w[near[5]] = w[near[3]]  # an exact tie
        x = torch.stack([base, base * 2, -base, base + 0.01 * torch.randn(hidden, generator=gen)])
        head, pw = _head(w)
        _check(head, pw, x)


def test_exact_ties_pick_the_first_index():
    weight = torch.zeros(300, 64)
    weight[:, 0] = 1.0
    weight[17, 0] = weight[250, 0] = 2.0
    head, pw = _head(weight)
    x = torch.zeros(3, 64)
    x[0, 0] = 1.0
    x[2, 0] = -1.0  # the ones (index 0 first) win over the twos
    assert head(x).tolist() == [17, 0, 0]
    _check(head, pw, x)


def test_rows_that_are_not_finite_take_torch_argmaxs_rule():
    """NaN logits: torch.argmax picks a row's first NaN; an infinity in x gives infinite (or
    NaN) logits; huge x could overflow the screen's bound: all take the exact path. A row of
    subnormal values is screened (the absolute slack) and rechecked."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 32, generator=gen)
    head, pw = _head(weight)
    x = torch.randn(6, 32, generator=gen)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    x[2] = x[2] * 1e36
    x[3] = 0.0  # every logit 0: index 0
    x[5] = x[5] * 1e-39  # below float's normal range, which vdpbf16ps flushes to 0
    _check(head, pw, x)
    assert head(x[:0]).shape == (0,)


def test_a_weight_that_is_not_finite_builds_no_head():
    weight = torch.randn(100, 32)
    weight[60, 5] = float("inf")
    assert GreedyHead.build(PackedWeight.pack(weight), cpu_kernel.cpu_greedy_head_op()) is None
    assert GreedyHead.build(PackedWeight.pack(torch.randn(100, 33)), lambda *a: a) is None  # odd K
    assert GreedyHead.build(PackedWeight.pack(torch.randn(100, 32)), None) is None


def test_the_column_norms_bound_the_weight():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(130, 96, generator=gen)
    head, _ = _head(weight)
    exact = weight.double().norm(dim=1)
    assert head.norms.shape == (3 * PANEL,)
    assert (head.norms[:130].double() >= exact).all() and not head.norms[130:].any()
    assert torch.allclose(head.norms[:130].double(), exact, rtol=2e-4)
    expected16 = weight.to(torch.bfloat16)  # round to nearest even, as the screen's x
    assert torch.equal(head.data16[1, 5, 7], expected16[PANEL + 7, 10:12])


def test_engine_tokens_are_the_same_with_and_without_it(tiny_model_dir, monkeypatch):
    """Greedy requests (the greedy head answers them), one sampled and one with logprobs in
    the same batches (the sampler answers the batch then): the same tokens either way."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    monkeypatch.delenv("RAYLORA_CPU_KERNEL", raising=False)
    if cpu_kernel.cpu_greedy_head_op() is None:
        pytest.skip("no greedy head here")

    def run(env: str) -> tuple[list[list[int]], bool]:
        monkeypatch.setenv("RAYLORA_GREEDY_HEAD", env)
        engine = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, seed=0))
        built = engine.model_runner.model.greedy_head is not None
        prompts = [[1 + i, 5, 9 + 3 * i, 2] * (i + 1) for i in range(6)]
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            if i == 4:
                params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
            if i == 5:
                params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        return [done[str(i)] for i in range(len(prompts))], built

    with_head, built = run("1")
    without, built_off = run("0")
    assert built and not built_off
    assert with_head == without
