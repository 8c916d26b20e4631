"""Graph-safe LoRA kernels: StaticLoRAMeta (device-only build) and the fixed-grid launches.

A CUDA graph replays one launch configuration over the same buffers for every step, so the
tests here run ONE configuration (same T, same tiles, same buffer addresses: checked by
recording every launch) against a meta updated in place, for adapter mixes in turn, and
compare with the fp32 references of raylora_kernels.torch_ops. Triton runs on the CPU under
TRITON_INTERPRET=1 (set with monkeypatch, as tests/test_kernels.py does).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager

import pytest
import torch

from raylora_kernels import (
    LoRABatchMeta,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)
from raylora_kernels.metadata import StaticLoRAMeta

shrink_mod = importlib.import_module("raylora_kernels.lora_shrink")
expand_mod = importlib.import_module("raylora_kernels.lora_expand")
NUM_SLOTS = 8  # L
NUM_TOKENS = 40  # T, the capture size: 3 m tiles of 16 when one slot has every token
RANK = 16
HIDDEN_IN = 64
WIDTHS = [64, 32, 32]  # q/k/v under GQA
NAN = float("nan")

# Adapter mixes, each a batch of at most T tokens (the rest of the T rows is padding).
MIXES = {
    "none": [-1] * 37,
    "one_adapter": [5] * NUM_TOKENS,
    "all_distinct": [6, 2, 7, 0, 3, 1, 5, 4],  # 8 tokens: 32 padding rows
    "base_mixed_in": [3, -1, 0, 3, 7, -1, 0, 3, -1, -1, 7, 1, 3, 3, -1, 0, 6, 3, 3, 3, 3, 3, -1]
    + [3] * 14,  # unsorted, -1 interleaved, one slot with 3 m tiles of tokens
}


def _slots(mix: str) -> torch.Tensor:
    return torch.tensor(MIXES[mix], dtype=torch.int32)


def _padded(slots: torch.Tensor) -> torch.Tensor:
    pad = torch.full((NUM_TOKENS - len(slots),), -1, dtype=torch.int32)
    return torch.cat([slots, pad])


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


class LaunchRecorder:
    """Wraps a LazyJit kernel: records each launch's grid, its tensors' addresses and its
    other arguments (constexpr config included), then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            key = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
            self.launches.append((grid, key, tuple(sorted(kwargs.items()))))
            return launch(*args, **kwargs)

        return call


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_TOKENS, HIDDEN_IN, generator=gen)
    lora_a = [torch.randn(NUM_SLOTS, RANK, HIDDEN_IN, generator=gen) * 0.125 for _ in WIDTHS]
    lora_b = [torch.randn(NUM_SLOTS, w, RANK, generator=gen) * 0.25 for w in WIDTHS]
    buf = torch.randn(len(WIDTHS), NUM_TOKENS, RANK, generator=gen)
    y = torch.randn(NUM_TOKENS, sum(WIDTHS), generator=gen)
    return x, lora_a, lora_b, buf, y


def _bitwise_equal_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor) -> bool:
    a, b = a.index_select(-2, rows).contiguous(), b.index_select(-2, rows).contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN poison included


@pytest.mark.parametrize("config", [None, dict(BLOCK_K=16, SPLIT_K=2)])
def test_one_launch_config_serves_every_mix(interpret, monkeypatch, config):
    """Shrink then expand for each mix in turn with one meta updated in place, the same x / out /
    y buffers and one launch configuration; split-K zeroes only the adapter tokens' rows."""
    shrink_rec = LaunchRecorder(shrink_mod._kernel)
    expand_rec = LaunchRecorder(expand_mod._kernel)
    monkeypatch.setattr(shrink_mod, "_kernel", shrink_rec)
    monkeypatch.setattr(expand_mod, "_kernel", expand_rec)
    x0, lora_a, lora_b, buf0, y0 = _inputs(seed=1)
    meta = StaticLoRAMeta.allocate(NUM_TOKENS, NUM_SLOTS)
    out = torch.empty(len(WIDTHS), NUM_TOKENS, RANK)
    x, buf, y = x0.clone(), buf0.clone(), y0.clone()
    for mix in MIXES:
        batch = _slots(mix)
        slots = _padded(batch)
        base_rows = torch.nonzero(slots < 0).flatten()
        assert meta.update_(batch) is meta
        x.copy_(x0)
        x[len(batch) :] = NAN  # padding rows: garbage the kernels must never read
        out.fill_(NAN)
        before = out.clone()
        if config is None:
            lora_shrink(x, lora_a, meta, scale=0.5, out=out, backend="triton")
        else:
            shrink_mod.lora_shrink_static(x, lora_a, meta, 0.5, out, config=config)
        ref = lora_shrink_ref(x, lora_a, slots, scale=0.5, out=before)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
        assert _bitwise_equal_rows(out, before, base_rows), f"{mix}: base rows changed"
        if mix != "none":
            assert not out[:, slots >= 0].isnan().any(), f"{mix}: adapter rows not written"

        buf.copy_(buf0)
        buf[:, base_rows] = NAN  # rows the expand must never read
        y.copy_(y0)
        want = lora_expand_ref(buf, lora_b, slots, y)
        lora_expand(buf, lora_b, meta, y, backend="triton")
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        assert _bitwise_equal_rows(y, y0, base_rows), f"{mix}: base rows of y changed"
        if mix == "none":
            assert torch.equal(y, y0)
    for rec in (shrink_rec, expand_rec):
        assert len(rec.launches) == len(MIXES)
        assert len(set(rec.launches)) == 1, "the launch changed with the adapter mix"
    grid = shrink_rec.launches[0][0]
    assert grid[1:] == (len(WIDTHS), NUM_SLOTS)  # (tiles, slices, every slot)
    assert expand_rec.launches[0][0][1:] == (len(WIDTHS), NUM_SLOTS)


@pytest.mark.parametrize("split_k", [1, 2])
def test_ranks_below_slot_rank(interpret, split_k):
    """With `ranks` (SlotWeights.ranks_device), weights and shrink columns past a slot's rank
    on a slice hold NaN garbage that must not reach the results, under one fixed launch."""
    x, lora_a, lora_b, _, y0 = _inputs(seed=2)
    ranks = torch.full((NUM_SLOTS, len(WIDTHS)), RANK, dtype=torch.int32)
    ranks[0] = torch.tensor([4, 4, 4])
    ranks[3] = torch.tensor([1, 8, 0])  # slot 3 does not target v
    ranks[7] = torch.tensor([0, 5, 0])  # slot 7 targets only k
    cut_a = [a.clone() for a in lora_a]
    cut_b = [b.clone() for b in lora_b]
    for slot in range(NUM_SLOTS):
        for s, r in enumerate(ranks[slot].tolist()):
            cut_a[s][slot, r:] = 0
            cut_b[s][slot, :, r:] = 0
            lora_a[s][slot, r:] = NAN
            lora_b[s][slot, :, r:] = NAN
    meta = StaticLoRAMeta.allocate(NUM_TOKENS, NUM_SLOTS)
    out = torch.empty(len(WIDTHS), NUM_TOKENS, RANK)
    cfg = dict(BLOCK_K=16, SPLIT_K=split_k)
    for mix in ("base_mixed_in", "all_distinct", "one_adapter"):
        batch = _slots(mix)
        if mix == "one_adapter":
            batch = torch.full_like(batch, 3)
        slots = _padded(batch)
        lora_rows = torch.nonzero(slots >= 0).flatten()
        meta.update_(batch)
        out.fill_(7.0)
        shrink_mod.lora_shrink_static(x, lora_a, meta, 1.0, out, config=cfg, ranks=ranks)
        ref = lora_shrink_ref(x, cut_a, slots, out=torch.full_like(out, 7.0))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # zeros past the rank
        buf = out.clone()
        for t in lora_rows.tolist():  # poison what the expand must not read
            for s in range(len(WIDTHS)):
                buf[s, t, int(ranks[int(slots[t]), s]) :] = NAN
        y = y0.clone()
        lora_expand(buf, lora_b, meta, y, backend="triton", ranks=ranks)
        want = lora_expand_ref(ref, cut_b, slots, y0)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    blind = y0.clone()  # the test sees the garbage: ignoring the ranks reads NaN
    lora_expand(buf, lora_b, meta, blind, backend="triton")
    assert blind[lora_rows].isnan().any()


def _grouping(slots: list[int], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Brute force: (sorted token ids, count per slot, start per slot) over every slot."""
    order = [t for slot in range(num_slots) for t, s in enumerate(slots) if s == slot]
    order += [t for t, s in enumerate(slots) if s < 0]
    counts = [slots.count(slot) for slot in range(num_slots)]
    starts = [sum(counts[:slot]) for slot in range(num_slots)]
    return order, counts, starts


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_build_static_groups_like_build(mix, dtype):
    batch = _slots(mix).to(dtype)
    meta = LoRABatchMeta.build_static(batch, NUM_SLOTS, max_num_tokens=NUM_TOKENS)
    assert isinstance(meta, StaticLoRAMeta) and meta.num_tokens == NUM_TOKENS
    assert not meta.no_lora  # never known without a sync (see StaticLoRAMeta)
    padded = _padded(batch.to(torch.int32)).tolist()
    order, counts, starts = _grouping(padded, NUM_SLOTS)
    assert meta.token_slots.tolist() == padded
    assert meta.sorted_token_ids.tolist() == order
    assert meta.num_tokens_per_slot.tolist() == counts
    assert meta.slot_starts.tolist() == starts
    assert meta.active_slots.tolist() == list(range(NUM_SLOTS))
    assert meta.lora_token_mask.tolist() == [s >= 0 for s in padded]
    for t in (meta.token_slots, meta.sorted_token_ids, meta.num_tokens_per_slot):
        assert t.dtype == torch.int32
    eager = LoRABatchMeta.build(batch, NUM_SLOTS)  # the same grouping on its active slots
    n = eager.num_lora_tokens
    assert meta.sorted_token_ids[:n].tolist() == eager.sorted_token_ids[:n].tolist()
    active = eager.active_slots.long()
    assert meta.num_tokens_per_slot[active].tolist() == eager.num_tokens_per_slot.tolist()
    assert meta.slot_starts[active].tolist() == eager.slot_starts.tolist()


def test_update_in_place_keeps_addresses_and_rejects_oversize():
    meta = StaticLoRAMeta.allocate(NUM_TOKENS, NUM_SLOTS)
    fields = (meta.token_slots, meta.sorted_token_ids, meta.num_tokens_per_slot)
    ptrs = [t.data_ptr() for t in fields + (meta.slot_starts, meta.lora_token_mask)]
    for mix in MIXES:
        meta.update_(_slots(mix))
    meta.update_(torch.tensor([], dtype=torch.int64))  # an empty batch: all padding
    assert ptrs == [t.data_ptr() for t in fields + (meta.slot_starts, meta.lora_token_mask)]
    assert meta.num_tokens_per_slot.eq(0).all() and meta.token_slots.eq(-1).all()
    meta.update_(torch.tensor([9, 2, -3], dtype=torch.int32))  # outside [0, L): no adapter
    assert meta.num_tokens_per_slot.tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert meta.sorted_token_ids[0] == 1 and meta.lora_token_mask.sum() == 1
    with pytest.raises(AssertionError, match="41 tokens for a meta of 40"):
        meta.update_(torch.zeros(NUM_TOKENS + 1, dtype=torch.int32))


def _raise(*args, **kwargs):
    raise AssertionError("host sync")


@contextmanager
def forbid_host_syncs():
    """Patch every torch entry point that moves device data to the host or sizes an output
    from the data (each is a sync on CUDA, and none can run inside a graph capture)."""
    mp = pytest.MonkeyPatch()
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        mp.setattr(torch.Tensor, name, _raise)
    for name in ("nonzero", "unique", "unique_consecutive", "bincount", "masked_select", "numpy"):
        mp.setattr(torch.Tensor, name, _raise)
        if hasattr(torch, name):
            mp.setattr(torch, name, _raise)
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def no_mask(index) -> None:  # boolean-mask indexing sizes its result from the data
        for i in index if isinstance(index, tuple) else (index,):
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                raise AssertionError("host sync")

    mp.setattr(torch.Tensor, "__getitem__", lambda t, i: (no_mask(i), getitem(t, i))[1])
    mp.setattr(torch.Tensor, "__setitem__", lambda t, i, v: (no_mask(i), setitem(t, i, v))[0])
    try:
        yield
    finally:
        mp.undo()


def test_build_static_never_syncs():
    batch = _slots("base_mixed_in")
    with forbid_host_syncs():
        with pytest.raises(AssertionError, match="host sync"):  # the guard sees a sync
            LoRABatchMeta.build(batch, NUM_SLOTS)
        meta = LoRABatchMeta.build_static(batch, NUM_SLOTS, max_num_tokens=NUM_TOKENS)
        for mix in MIXES:
            meta.update_(_slots(mix))
        meta.update_(batch)
    order, counts, starts = _grouping(_padded(batch).tolist(), NUM_SLOTS)
    assert meta.sorted_token_ids.tolist() == order
    assert meta.num_tokens_per_slot.tolist() == counts
    assert meta.slot_starts.tolist() == starts


def test_static_meta_needs_triton_backend():
    x, lora_a, lora_b, buf, y = _inputs(seed=3)
    meta = StaticLoRAMeta.build(_padded(_slots("all_distinct")), NUM_SLOTS)
    with pytest.raises(AssertionError, match="StaticLoRAMeta is for the Triton kernels"):
        lora_shrink(x, lora_a, meta, backend="torch")
    with pytest.raises(AssertionError, match="StaticLoRAMeta is for the Triton kernels"):
        lora_expand(buf, lora_b, meta, y, backend="torch")
    with pytest.raises(AssertionError, match="meta was built for 40 tokens"):
        lora_shrink(x[:8], lora_a, meta, backend="triton")
