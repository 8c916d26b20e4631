"""raylora_kernels/: lora_shrink / lora_expand (Triton under TRITON_INTERPRET=1, and torch) vs fp32 refs.

The Triton kernels run on CPU through the interpreter. `raylora_kernels.utils.LazyJit`
decorates them at launch time, so setting TRITON_INTERPRET with monkeypatch works
even when another test module imported triton/raylora_kernels first (checked in a fresh
subprocess by `test_interpret_env_set_after_import`).

The parametrization is a covering subset: every (rank, popularity pattern) pair,
with batch sizes, widths, slice counts and dtypes cycled through so that each value
appears several times. RAYLORA_FULL_KERNEL_TESTS=1 runs the full cross product.
"""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raylora_kernels import (
    LoRABatchMeta,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from raylora_kernels.lora_expand import lora_expand_triton
from raylora_kernels.lora_shrink import lora_shrink_triton
from raylora_kernels.torch_ops import lora_expand_torch, lora_shrink_torch

# The package re-exports functions named like their modules: fetch the modules themselves.
shrink_mod = importlib.import_module("raylora_kernels.lora_shrink")
expand_mod = importlib.import_module("raylora_kernels.lora_expand")
REPO = Path(__file__).resolve().parents[1]
NUM_SLOTS = 8  # L
RANKS = [1, 4, 8, 16, 64]
PATTERNS = ["distinct", "identical", "uniform", "zipf", "skewed"]
BATCHES = [1, 3, 7, 133]
# (H_in, [H_out per slice]): tiny, odd, SmolLM2 q/k/v (GQA), odd two-slice, gate/up
WIDTHS = [(64, [64]), (97, [131, 45]), (576, [576, 192, 192]), (300, [1000]), (576, [1536, 1536])]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {  # (atol, rtol) vs the fp32 reference, values are O(1)
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 1e-2),
    torch.bfloat16: (8e-2, 3e-2),
}


def _cases() -> list[tuple]:
    if os.environ.get("RAYLORA_FULL_KERNEL_TESTS") == "1":
        return list(itertools.product(RANKS, PATTERNS, BATCHES, range(len(WIDTHS)), DTYPES))
    cases = []
    for i, (rank, pattern) in enumerate(itertools.product(RANKS, PATTERNS)):
        cases.append(
            (rank, pattern, BATCHES[i % 4], (i * 2) % len(WIDTHS), DTYPES[(i + i // 5) % 3])
        )
    return cases


CASES = _cases()


def make_slots(pattern: str, num_tokens: int, gen: torch.Generator, frac_none: float = 0.25):
    """Slot per token following a popularity pattern; about frac_none of them get -1."""
    if pattern == "distinct":
        slots = torch.randperm(NUM_SLOTS, generator=gen).repeat(num_tokens // NUM_SLOTS + 1)
        slots = slots[:num_tokens]
    elif pattern == "identical":
        slots = torch.full((num_tokens,), 5)
    else:
        if pattern == "uniform":
            p = torch.ones(NUM_SLOTS)
        elif pattern == "zipf":
            p = 1.0 / torch.arange(1, NUM_SLOTS + 1).float() ** 1.2
        else:  # skewed: one hot adapter, a long tail
            p = torch.full((NUM_SLOTS,), 0.1 / (NUM_SLOTS - 1))
            p[3] = 0.9
        slots = torch.multinomial(p, num_tokens, replacement=True, generator=gen)
    none = torch.rand(num_tokens, generator=gen) < frac_none
    if num_tokens >= 3:
        none[1] = True  # always some no-adapter tokens, and always some adapter ones
        none[0] = False
    return torch.where(none, -1, slots).to(torch.int32)


def make_inputs(rank, widths_idx, num_tokens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden_in, widths = WIDTHS[widths_idx]

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    x = randn(num_tokens, hidden_in)
    lora_a = [randn(NUM_SLOTS, rank, hidden_in, std=hidden_in**-0.5) for _ in widths]
    lora_b = [randn(NUM_SLOTS, w, rank, std=rank**-0.5) for w in widths]
    buf = torch.randn(len(widths), num_tokens, rank, generator=gen)
    y = randn(num_tokens, sum(widths))
    return gen, x, lora_a, lora_b, buf, y


def assert_rows_identical(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> None:
    """Bitwise equality (NaN poison included) of the given rows along dim -2."""
    a, b = a.index_select(-2, rows).contiguous(), b.index_select(-2, rows).contiguous()
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
        "rows of no-adapter tokens changed"
    )


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run_shrink(backend, x, lora_a, meta, scale, out, strategy):
    if backend == "triton":
        return lora_shrink(x, lora_a, meta, scale, out, backend="triton")
    return lora_shrink_torch(x, lora_a, meta, scale, out, strategy=strategy)


BACKENDS = [
    ("triton", None),
    ("torch", "dense"),
    ("torch", "segments"),
    ("torch", None),
    ("torch", "sgmv"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,strategy", BACKENDS)
@pytest.mark.parametrize("rank,pattern,num_tokens,widths_idx,dtype", CASES)
def test_shrink_matches_ref(
    interpret, backend, strategy, rank, pattern, num_tokens, widths_idx, dtype
):
    gen, x, lora_a, _, _, _ = make_inputs(rank, widths_idx, num_tokens, dtype, seed=num_tokens)
    slots = make_slots(pattern, num_tokens, gen)
    meta = LoRABatchMeta.build(slots, NUM_SLOTS)
    out = torch.full((len(lora_a), num_tokens, rank), float("nan"))  # poison
    ref = lora_shrink_ref(x, lora_a, slots, scale=0.5, out=out)
    before = out.clone()
    got = _run_shrink(backend, x, lora_a, meta, 0.5, out, strategy)
    assert got is out
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    assert_rows_identical(out, before, torch.nonzero(slots < 0).flatten())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,strategy", BACKENDS[:1] + [("torch", "gather")] + BACKENDS[2:])
@pytest.mark.parametrize("rank,pattern,num_tokens,widths_idx,dtype", CASES)
def test_expand_matches_ref(
    interpret, backend, strategy, rank, pattern, num_tokens, widths_idx, dtype
):
    gen, _, _, lora_b, buf, y = make_inputs(
        rank, widths_idx, num_tokens, dtype, seed=num_tokens + 1
    )
    slots = make_slots(pattern, num_tokens, gen)
    meta = LoRABatchMeta.build(slots, NUM_SLOTS)
    none_rows = torch.nonzero(slots < 0).flatten()
    buf[:, none_rows] = float("nan")  # rows the expand must never read
    atol, rtol = TOL[dtype]
    for add_inputs in (True, False):
        if not add_inputs:
            y = torch.full_like(y, float("nan"))  # poison: every lora row must be written
        ref = lora_expand_ref(buf, lora_b, slots, y, add_inputs=add_inputs)
        before = y.clone()
        offsets = [sum(b.shape[1] for b in lora_b[:s]) for s in range(len(lora_b))]
        if backend == "triton":
            lora_expand(buf, lora_b, meta, y, add_inputs=add_inputs, backend="triton")
        else:
            lora_expand_torch(buf, lora_b, meta, y, offsets, add_inputs, strategy=strategy)
        torch.testing.assert_close(y.float(), ref, atol=atol, rtol=rtol, equal_nan=True)
        assert_rows_identical(y, before, none_rows)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("num_tokens", [0, 5])
def test_base_only_batch_launches_nothing(interpret, monkeypatch, backend, num_tokens):
    gen, x, lora_a, lora_b, buf, y = make_inputs(4, 2, num_tokens, torch.float16, seed=0)
    meta = LoRABatchMeta.build(torch.full((num_tokens,), -1, dtype=torch.int64), NUM_SLOTS)
    assert meta.no_lora and meta.num_active_slots == 0 and meta.max_tokens_per_slot == 0

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("kernel launched for a base-only batch")

        def __call__(self, *args, **kwargs):
            raise AssertionError("torch path dispatched for a base-only batch")

    for mod in (shrink_mod, expand_mod):
        monkeypatch.setattr(mod, "_kernel", NoLaunch())
    monkeypatch.setattr(shrink_mod, "lora_shrink_torch", NoLaunch())
    monkeypatch.setattr(expand_mod, "lora_expand_torch", NoLaunch())
    out = torch.full((3, num_tokens, 4), float("nan"))
    y_before = y.clone()
    assert lora_shrink(x, lora_a, meta, out=out, backend=backend) is out
    lora_expand(buf, lora_b, meta, y, backend=backend)
    assert torch.isnan(out).all()
    assert torch.equal(y, y_before)


@pytest.mark.parametrize(
    "config", [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4), dict(BLOCK_K=32, SPLIT_K=2)]
)
def test_shrink_triton_split_k_and_tiles(interpret, config):
    """Small tiles (several m/n/k tiles) and split-K atomics, with no-adapter tokens."""
    gen, x, lora_a, _, _, _ = make_inputs(64, 1, 133, torch.float32, seed=7)
    slots = make_slots("skewed", 133, gen)
    meta = LoRABatchMeta.build(slots, NUM_SLOTS)
    out = torch.full((2, 133, 64), float("nan"))
    ref = lora_shrink_ref(x, lora_a, slots, scale=2.0, out=out)
    before = out.clone()
    lora_shrink_triton(x, lora_a, meta, 2.0, out, config=config)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    assert_rows_identical(out, before, torch.nonzero(slots < 0).flatten())


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_expand_offsets_with_gaps(interpret, backend):
    """Explicit offsets: columns outside the slices are never touched; small tiles."""
    gen, _, _, lora_b, buf, _ = make_inputs(64, 1, 40, torch.float16, seed=3)
    slots = make_slots("uniform", 40, gen)
    meta = LoRABatchMeta.build(slots, NUM_SLOTS)
    y = torch.randn(40, 200, generator=gen).to(torch.float16)
    offsets = [60, 3]  # slice 0: [60, 191), slice 1: [3, 48)
    ref = lora_expand_ref(buf, lora_b, slots, y, offsets=offsets)
    before = y.clone()
    if backend == "triton":
        lora_expand_triton(buf, lora_b, meta, y, offsets, True, config=dict(BLOCK_N=16, BLOCK_K=16))
    else:
        lora_expand(buf, lora_b, meta, y, offsets=offsets, backend="torch")
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)
    untouched = torch.cat([torch.arange(0, 3), torch.arange(48, 60), torch.arange(191, 200)])
    assert torch.equal(y[:, untouched], before[:, untouched])


def test_meta_layout():
    slots = torch.tensor([2, -1, 0, 2, 5, -1, 0, 2], dtype=torch.int32)
    meta = LoRABatchMeta.build(slots, 6)
    assert meta.sorted_token_ids.tolist() == [2, 6, 0, 3, 7, 4, 1, 5]  # stable, -1 last
    assert meta.active_slots.tolist() == [0, 2, 5]
    assert meta.num_tokens_per_slot.tolist() == [2, 3, 1]
    assert meta.slot_starts.tolist() == [0, 2, 5]
    assert meta.max_tokens_per_slot == 3 and meta.num_lora_tokens == 6 and not meta.no_lora
    assert meta.lora_token_slots.tolist() == [0, 0, 2, 2, 2, 5]
    assert meta.token_slots.dtype == torch.int32 and meta.sorted_token_ids.dtype == torch.int32
    with pytest.raises(AssertionError, match="max_loras"):
        LoRABatchMeta.build(torch.tensor([0, 6]), 6)
    with pytest.raises(AssertionError, match="< -1"):
        LoRABatchMeta.build(torch.tensor([0, -2]), 6)


def test_wrappers_reject_bad_arguments(monkeypatch):
    _, x, lora_a, lora_b, buf, y = make_inputs(4, 2, 5, torch.float16, seed=0)
    meta = LoRABatchMeta.build(torch.tensor([0, 1, -1, 1, 0]), NUM_SLOTS)
    with pytest.raises(AssertionError, match="x dtype"):
        lora_shrink(x.float(), lora_a, meta)
    with pytest.raises(AssertionError, match="lora_a\\[0\\] must be"):
        lora_shrink(x, [a.transpose(1, 2) for a in lora_a], meta)
    strided = lora_a[1].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    with pytest.raises(AssertionError, match="strides"):
        lora_shrink(x, [lora_a[0], strided, lora_a[2]], meta)
    with pytest.raises(AssertionError, match="strides"):
        lora_expand(buf, [lora_b[0], lora_b[1].mT.contiguous().mT, lora_b[2]], meta, y)
    with pytest.raises(AssertionError, match="lora_a\\[1\\] must be"):
        lora_shrink(x, [lora_a[0], lora_a[1][:, :2]], meta)
    with pytest.raises(AssertionError, match="meta was built for 5 tokens"):
        lora_shrink(x[:3], lora_a, meta)
    with pytest.raises(AssertionError, match="y has 900 columns"):
        lora_expand(buf, lora_b, meta, torch.zeros(5, 900, dtype=torch.float16))
    with pytest.raises(AssertionError, match="out of y"):
        lora_expand(buf, lora_b, meta, y, offsets=[0, 576, 800])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AssertionError, match="TRITON_INTERPRET"):
        lora_shrink(x, lora_a, meta, backend="triton")


def _run(args: list[str], env: dict[str, str], timeout: int) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


SNIPPET = """
import os, torch, triton  # triton imported (and raylora_kernels) before TRITON_INTERPRET is set
from raylora_kernels import LoRABatchMeta, lora_shrink, lora_expand, lora_shrink_ref, lora_expand_ref
os.environ["TRITON_INTERPRET"] = "1"
slots = torch.tensor([1, -1, 0, 1])
x, a, b = torch.randn(4, 32), [torch.randn(2, 4, 32)], [torch.randn(2, 24, 4)]
meta = LoRABatchMeta.build(slots, 2)
buf = lora_shrink(x, a, meta, backend="triton")
assert torch.allclose(buf, lora_shrink_ref(x, a, slots), atol=1e-4)
y = torch.randn(4, 24)
ref = lora_expand_ref(buf, b, slots, y)
lora_expand(buf, b, meta, y, backend="triton")
assert torch.allclose(y, ref, atol=1e-4)
print("ok")
"""


def test_interpret_env_set_after_import():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    assert _run(["-c", SNIPPET], env, timeout=120).strip().endswith("ok")


@pytest.mark.timeout(180)
def test_benchmark_dry_run():
    out = _run(
        ["benchmarks/lora_kernels.py", "--tiny", "--interpret"], dict(os.environ), timeout=170
    )
    assert "all checks passed" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split_k", [1, 4])
def test_triton_kernels_read_only_each_slices_rank(interpret, split_k):
    """With `ranks` (SlotWeights.ranks_device) the Triton kernels read no weight row past a
    slot's rank on a slice, nor those columns of the shrink's output: NaN garbage there must
    not reach the results, the shrink writes zeros there, and without the ranks the same
    inputs give NaN (so the test sees the garbage)."""
    gen, x, lora_a, lora_b, _, y = make_inputs(16, 2, 12, torch.float32, seed=3)
    # 3 slices (q, k, v shapes); slot 6 targets only k, slot 2 q at rank 1
    ranks = torch.zeros(NUM_SLOTS, len(lora_a), dtype=torch.int32)
    ranks[1] = torch.tensor([16, 16, 16])
    ranks[2] = torch.tensor([1, 8, 4])
    ranks[6] = torch.tensor([0, 5, 0])
    cut_a = [a.clone() for a in lora_a]
    cut_b = [b.clone() for b in lora_b]
    for slot in range(NUM_SLOTS):
        for s, r in enumerate(ranks[slot].tolist()):
            cut_a[s][slot, r:] = 0
            cut_b[s][slot, :, r:] = 0
            lora_a[s][slot, r:] = float("nan")
            lora_b[s][slot, :, r:] = float("nan")
    slots = torch.tensor([1, 1, 1, 2, 2, -1, 6, 6, 6, 6, -1, 1])
    meta = LoRABatchMeta.build(slots, NUM_SLOTS)
    lora_rows = torch.nonzero(slots >= 0).flatten()
    out = torch.full((len(lora_a), len(slots), 16), 7.0)
    lora_shrink_triton(x, lora_a, meta, 1.0, out, config={"SPLIT_K": split_k}, ranks=ranks)
    ref = lora_shrink_ref(x, cut_a, slots)
    torch.testing.assert_close(out[:, lora_rows], ref[:, lora_rows], atol=1e-4, rtol=1e-4)
    assert out[:, 5].eq(7).all()  # base tokens' rows untouched
    buf = out.clone()
    for s in range(len(lora_a)):  # poison what the expand must not read
        for t in lora_rows.tolist():
            buf[s, t, int(ranks[int(slots[t]), s]) :] = float("nan")
    got = y.clone()
    lora_expand(buf, lora_b, meta, got, backend="triton", ranks=ranks)
    want = lora_expand_ref(ref, cut_b, slots, y.clone())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    blind = y.clone()
    lora_expand(buf, lora_b, meta, blind, backend="triton")
    assert blind[lora_rows].isnan().any()  # ignoring the ranks would read the garbage
