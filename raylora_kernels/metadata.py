"""Per-step LoRA batch metadata: tokens grouped by adapter slot (punica SGMV layout).

Two kinds, one layout (`sorted_token_ids`, `num_tokens_per_slot`, `slot_starts`,
`active_slots`, the fields the Triton kernels read):

- `LoRABatchMeta.build`: eager steps. One host sync per step buys exact grids (only the
  active slots, only as many token tiles as the longest slot) and the host fields the torch
  and C++ paths need.
- `StaticLoRAMeta` (`LoRABatchMeta.build_static`): CUDA-graph steps. Fixed shapes over every
  slot, preallocated buffers rewritten in place by device ops only (no host sync), so a graph
  captured for one adapter mix replays correctly for any other.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

_NO_ADAPTER_KEY = 2**62  # sort key of slot -1: after every real slot


@dataclass(frozen=True, slots=True)
class LoRABatchMeta:
    """Which slot each token uses, with tokens grouped by slot.

    Build it ONCE per forward step with `LoRABatchMeta.build` and reuse it for every
    LoRA linear of every layer: the build sorts the tokens and syncs with the host
    once (for the grid sizes); the ops never sync.

    Layout: `sorted_token_ids` lists the token indices with an adapter first, grouped
    by slot in ascending slot order (stable: token order is kept inside a slot),
    followed by the tokens with slot -1 (no adapter). The i-th active slot owns
    `sorted_token_ids[slot_starts[i] : slot_starts[i] + num_tokens_per_slot[i]]`.
    Tokens with slot -1 belong to no segment, so the kernels never visit them.
    """

    token_slots: torch.Tensor  # [T] int32, slot of each token, -1 = no adapter
    sorted_token_ids: torch.Tensor  # [T] int32, adapter tokens grouped by slot, then -1 tokens
    num_tokens_per_slot: torch.Tensor  # [A] int32
    slot_starts: torch.Tensor  # [A] int32, offset of each segment in sorted_token_ids
    active_slots: torch.Tensor  # [A] int32, ascending
    max_tokens_per_slot: int
    no_lora: bool  # True when no token has an adapter: the ops return at once
    # True when sorted_token_ids is 0..T-1: the tokens already come grouped by slot (adapter
    # tokens first, ascending slot, then the no-adapter ones), as the model runner orders
    # them, so the torch path can use views of x and y instead of gathers and scatters.
    tokens_sorted: bool
    # True when tokens_sorted and every active slot has max_tokens_per_slot tokens (decode):
    # the adapter tokens are a [A, max_tokens_per_slot] grid of x's first rows.
    uniform: bool
    num_tokens: int  # T
    num_lora_tokens: int  # tokens with slot >= 0 (the first ones of sorted_token_ids)
    # For the torch path (int64 because index_copy_/index_fill_ want it):
    lora_token_ids: torch.Tensor  # [num_lora_tokens] int64, = sorted_token_ids[:num_lora_tokens]
    lora_token_slots: torch.Tensor  # [num_lora_tokens] int64, slot of each of lora_token_ids
    # Padded SGMV layout for the torch path: segment i's tokens in row i, padded with token 0.
    padded_token_ids: torch.Tensor  # [A, max_tokens_per_slot] int64
    padded_rows: torch.Tensor  # [num_lora_tokens] int64, row of each lora token in the flat pad
    active_slots_long: torch.Tensor  # [A] int64
    # Host copies of the [A] tensors, for the torch path's loop over slots (no syncs).
    active_slots_list: tuple[int, ...]
    slot_starts_list: tuple[int, ...]
    num_tokens_per_slot_list: tuple[int, ...]
    # Runs of consecutive slot numbers among the active slots: (first slot, end slot, first
    # active index), so the torch path can slice the stacked weights instead of copying them.
    active_slot_runs: tuple[tuple[int, int, int], ...]
    # int64 [3, A] on the host: each active slot, its first row in sorted order, its token count
    # (the C++ CPU kernel's segment table, raylora_kernels/cpu_kernel.py).
    segments: torch.Tensor

    @property
    def num_active_slots(self) -> int:
        return len(self.active_slots_list)

    @staticmethod
    def build_static(
        token_slots: torch.Tensor, max_loras: int, max_num_tokens: int | None = None
    ) -> StaticLoRAMeta:
        """`StaticLoRAMeta.build`: the graph-safe meta (device ops only, no host sync)."""
        return StaticLoRAMeta.build(token_slots, max_loras, max_num_tokens)

    @classmethod
    def build(cls, token_slots: torch.Tensor, max_loras: int) -> LoRABatchMeta:
        """Args:
        token_slots: [T] int32/int64 on the target device; -1 = no adapter,
            otherwise a slot in [0, max_loras).
        max_loras: number of slots L of the stacked weights.
        """
        assert token_slots.dim() == 1, (
            f"token_slots must be 1-D [T], got {tuple(token_slots.shape)}"
        )
        assert token_slots.dtype in (torch.int32, torch.int64), (
            f"token_slots must be int32 or int64, got {token_slots.dtype}"
        )
        assert max_loras >= 1, f"max_loras must be >= 1, got {max_loras}"
        num_tokens = token_slots.numel()
        slots = token_slots.to(torch.int64)
        # Sort key: -1 (no adapter) maps past every real slot so those tokens go last.
        key = torch.where(slots == -1, _NO_ADAPTER_KEY, slots)
        sorted_key, order = torch.sort(key, stable=True)
        uniq, counts = torch.unique_consecutive(sorted_key, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        in_order = (order == torch.arange(num_tokens, device=order.device)).all()
        # One host sync for everything the launches need: [uniq..., counts..., in_order].
        host = torch.cat([uniq, counts, in_order.view(1).to(torch.int64)]).tolist()
        num_groups = len(host) // 2
        uniq_l, counts_l, in_order_b = host[:num_groups], host[num_groups:-1], host[-1]
        starts_l = list(itertools.accumulate(counts_l, initial=0))[:-1]
        assert not uniq_l or uniq_l[0] >= 0, f"token_slots has slot {uniq_l[0]} < -1"
        if uniq_l and uniq_l[-1] == _NO_ADAPTER_KEY:  # drop the no-adapter group
            uniq_l, counts_l, starts_l = uniq_l[:-1], counts_l[:-1], starts_l[:-1]
        assert not uniq_l or uniq_l[-1] < max_loras, (
            f"token_slots has slot {uniq_l[-1]} >= max_loras={max_loras}"
        )
        num_active = len(uniq_l)
        num_lora_tokens = sum(counts_l)
        max_n = max(counts_l, default=0)
        lora_ids = order[:num_lora_tokens]
        pad_rows = [i * max_n + j for i, c in enumerate(counts_l) for j in range(c)]
        padded_rows = torch.tensor(pad_rows, dtype=torch.int64, device=token_slots.device)
        padded = torch.zeros(num_active * max_n, dtype=torch.int64, device=token_slots.device)
        padded[padded_rows] = lora_ids
        return cls(
            token_slots=token_slots.to(torch.int32).contiguous(),
            sorted_token_ids=order.to(torch.int32),
            num_tokens_per_slot=counts[:num_active].to(torch.int32),
            slot_starts=starts[:num_active].to(torch.int32),
            active_slots=uniq[:num_active].to(torch.int32),
            max_tokens_per_slot=max_n,
            no_lora=num_active == 0,
            tokens_sorted=bool(in_order_b),
            uniform=bool(in_order_b) and num_active * max_n == num_lora_tokens,
            num_tokens=num_tokens,
            num_lora_tokens=num_lora_tokens,
            lora_token_ids=order[:num_lora_tokens],
            lora_token_slots=sorted_key[:num_lora_tokens],
            padded_token_ids=padded.view(num_active, max_n),
            padded_rows=padded_rows,
            active_slots_long=uniq[:num_active].to(torch.int64),
            active_slots_list=tuple(uniq_l),
            slot_starts_list=tuple(starts_l),
            num_tokens_per_slot_list=tuple(counts_l),
            active_slot_runs=_runs(uniq_l),
            segments=torch.tensor([uniq_l, starts_l, counts_l], dtype=torch.int64).view(
                3, num_active
            ),
        )


@dataclass(frozen=True, slots=True)
class StaticLoRAMeta:
    """LoRABatchMeta's kernel fields at fixed shapes and fixed addresses, for CUDA graphs.

    Allocate once per capture size T (`allocate`), then `update_(token_slots)` before each
    replay: it rewrites the same tensors in place with device ops only (a stable sort, a
    searchsorted, copies: no .tolist/.item/nonzero/unique/bincount, which sync with the host
    or size their output from the data), so a graph captured for one adapter mix reads the
    next step's mix from the same addresses. update_ may also run inside the captured region.

    Layout: as LoRABatchMeta, but over EVERY slot, not only the active ones:
    `active_slots` is arange(L) and never changes; slot l owns
    `sorted_token_ids[slot_starts[l] : slot_starts[l] + num_tokens_per_slot[l]]`, and a slot no
    token uses has count 0 (its kernel programs exit at once). Tokens with slot -1, and the
    padding rows past the batch (update_ with fewer than T tokens), come last and belong to no
    slot. The kernels' grids come from (T, L) only (raylora_kernels.lora_shrink / lora_expand).

    `no_lora` is always False: whether a step has any adapter token is known only on the
    device. A base-only step launches the same grid; every program finds count 0 and exits,
    leaving the outputs untouched. Slot values are not checked (that needs a sync; `build`
    asserts them): a slot outside [-1, L) counts as no adapter, so no kernel reads past the
    stacked weights. There are no host fields: the torch and C++ paths take LoRABatchMeta.
    """

    token_slots: torch.Tensor  # [T] int32, slot of each token, -1 = no adapter (and padding)
    sorted_token_ids: torch.Tensor  # [T] int32, adapter tokens grouped by slot, then the rest
    num_tokens_per_slot: torch.Tensor  # [L] int32, 0 for a slot no token uses
    slot_starts: torch.Tensor  # [L] int32, offset of each slot's segment in sorted_token_ids
    active_slots: torch.Tensor  # [L] int32, = arange(L) (the kernels' segment -> slot table)
    lora_token_mask: torch.Tensor  # [T] bool, token has a slot in [0, L) (split-K zeroing)
    num_tokens: int  # T, the capture size
    max_loras: int  # L
    no_lora: ClassVar[bool] = False

    @classmethod
    def allocate(
        cls, num_tokens: int, max_loras: int, device: torch.device | str = "cpu"
    ) -> StaticLoRAMeta:
        """Buffers for T = num_tokens tokens and L = max_loras slots, all tokens slot -1."""
        assert num_tokens >= 0, f"num_tokens must be >= 0, got {num_tokens}"
        assert max_loras >= 1, f"max_loras must be >= 1, got {max_loras}"

        def ints(n: int, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int32, device=device)

        return cls(
            token_slots=ints(num_tokens, -1),
            sorted_token_ids=torch.arange(num_tokens, dtype=torch.int32, device=device),
            num_tokens_per_slot=ints(max_loras, 0),
            slot_starts=ints(max_loras, 0),
            active_slots=torch.arange(max_loras, dtype=torch.int32, device=device),
            lora_token_mask=torch.zeros(num_tokens, dtype=torch.bool, device=device),
            num_tokens=num_tokens,
            max_loras=max_loras,
        )

    @classmethod
    def build(
        cls, token_slots: torch.Tensor, max_loras: int, max_num_tokens: int | None = None
    ) -> StaticLoRAMeta:
        """`allocate(max_num_tokens or len(token_slots), max_loras)` then `update_`."""
        num_tokens = token_slots.numel() if max_num_tokens is None else max_num_tokens
        return cls.allocate(num_tokens, max_loras, token_slots.device).update_(token_slots)

    def update_(self, token_slots: torch.Tensor) -> StaticLoRAMeta:
        """Regroup in place for this step's slots; returns self. No host sync.

        token_slots: [n] int32/int64 with n <= T, -1 = no adapter; rows n..T-1 become
            padding (slot -1). On this meta's device, or a pinned CPU tensor (the copy is
            non_blocking; a pageable one makes it a host-blocking copy).
        """
        assert token_slots.dim() == 1, (
            f"token_slots must be 1-D [n], got {tuple(token_slots.shape)}"
        )
        assert token_slots.dtype in (torch.int32, torch.int64), (
            f"token_slots must be int32 or int64, got {token_slots.dtype}"
        )
        n = token_slots.numel()
        assert n <= self.num_tokens, f"{n} tokens for a meta of {self.num_tokens}"
        self.token_slots[:n].copy_(token_slots, non_blocking=True)
        self.token_slots[n:].fill_(-1)
        slots, num_slots = self.token_slots, self.max_loras
        torch.logical_and(slots >= 0, slots < num_slots, out=self.lora_token_mask)
        # Sort key: slot L for every token without one, so those come after all the slots.
        key = torch.where(self.lora_token_mask, slots, num_slots)
        sorted_key, order = torch.sort(key, stable=True)
        self.sorted_token_ids.copy_(order)
        # bounds[l] = number of tokens with key < l = first sorted row of slot l; bounds[L] is
        # the number of adapter tokens. (Not bincount: it sizes its output from max(input).)
        bounds = torch.searchsorted(
            sorted_key,
            torch.arange(num_slots + 1, dtype=torch.int32, device=slots.device),
            out_int32=True,
        )
        self.slot_starts.copy_(bounds[:num_slots])
        torch.sub(bounds[1:], bounds[:num_slots], out=self.num_tokens_per_slot)
        return self


_STATIC_TABLES: dict[tuple, torch.Tensor] = {}


def static_device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 [len(rows), S] tensor of per-slice launch values (weight data_ptrs, widths, ...),
    as `raylora_kernels.utils.device_table`, but never evicted: a captured CUDA graph keeps reading the
    address it saw at capture, so the tensor must outlive every graph. Cached by value; it
    grows with the number of distinct weight sets (fixed slot weights: a few per layer). The
    first call for a set copies host to device: make it in the warm-up run before capture."""
    key = (tuple(tuple(r) for r in rows), str(device))
    table = _STATIC_TABLES.get(key)
    if table is None:
        table = _STATIC_TABLES[key] = torch.tensor(rows, dtype=torch.int64, device=device)
    return table


def _runs(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], slot + 1, runs[-1][2])
        else:
            runs.append((slot, slot + 1, i))
    return tuple(runs)
