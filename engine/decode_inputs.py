"""Persistent decode inputs: the buffers every decode step (and its CUDA graph) reads.

A decode-only step does not build new tensors from Python lists: the model runner writes the
step's token ids, positions, cache slots, context lengths, LoRA slots and block tables into
one host staging buffer, and on a GPU one non-blocking host-to-device copy moves it (only the
prefix the step uses). The device tensors the forward reads are views of fixed addresses, so a
CUDA graph captured over them replays correctly with another batch written in. On the CPU the
staging buffer is the device buffer: no copy at all.

Layout of the buffer (bytes; M = max_num_seqs, W = max blocks per sequence):
    int64 input_ids[M] | positions[M] | slot_mapping[M] | int32 context_lens[M] |
    token_slots[M] | block_tables[M, W]
The block tables come last and row by row, so a step of n rows copies the sections before them
and n table rows: at most 8 * 3M + 4 * 2M + 4 * n * W bytes.

Padding rows (n real rows padded to a capture size, vLLM's cudagraph sizes): token 0 at
position 0, written to the first slot of a reserved null KV block that no sequence owns,
attending to that one slot, with no adapter (slot -1). Their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_INT64 = ("input_ids", "positions", "slot_mapping")
_INT32 = ("context_lens", "token_slots")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default decode capture sizes: 1, 2, 4, then every multiple of 8, up to
    max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass(frozen=True)
class DecodeStep:
    """One staged decode step: n real rows, padded to `padded`; views of the persistent
    buffers on the model's device ([padded] each, block_tables [padded, W])."""

    num_seqs: int
    padded: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    rows: torch.Tensor  # int64 arange(padded): the rows whose hidden states are kept
    context_lens: torch.Tensor
    token_slots: torch.Tensor
    block_tables: torch.Tensor
    max_blocks: int  # blocks of the longest row's table (host-side; eager steps only)


class DecodeInputs:
    """The persistent buffers of decode steps, and `stage` to fill them."""

    def __init__(
        self,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        null_block: int,
        device: torch.device,
        pad_sizes: Sequence[int] | None = None,
    ) -> None:
        """null_block: a KV block no sequence owns (the model runner allocates one past the
        scheduler's blocks). pad_sizes: the batch sizes a step is padded up to (the CUDA graph
        capture sizes); None: no padding (eager steps)."""
        m, w = max_num_seqs, max_blocks_per_seq
        self.max_num_seqs, self.width, self.block_size = m, w, block_size
        self.null_block = null_block
        self.pad_sizes = sorted(pad_sizes) if pad_sizes else None
        assert self.pad_sizes is None or self.pad_sizes[-1] >= m, (
            f"pad sizes {self.pad_sizes} must reach max_num_seqs={m}"
        )
        nbytes = 8 * len(_INT64) * m + 4 * len(_INT32) * m + 4 * m * w
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=gpu)
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device) if gpu else self.host
        self._table_offset = 8 * len(_INT64) * m + 4 * len(_INT32) * m
        self.np = self._views(self.host, as_numpy=True)  # written by stage()
        self.views = self._views(self.dev)  # read by the forward
        self.rows = torch.arange(m, dtype=torch.int64, device=self.device)
        self._pad_rows(0, m)

    def _views(self, buf: torch.Tensor, as_numpy: bool = False) -> dict:
        m, views, offset = self.max_num_seqs, {}, 0
        for names, dtype, size in ((_INT64, torch.int64, 8), (_INT32, torch.int32, 4)):
            for name in names:
                views[name] = buf[offset : offset + size * m].view(dtype)
                offset += size * m
        views["block_tables"] = buf[offset:].view(torch.int32).view(m, self.width)
        if as_numpy:
            views = {k: v.numpy() for k, v in views.items()}
        return views

    def padded_size(self, n: int) -> int:
        assert 1 <= n <= self.max_num_seqs, f"{n} decode rows, max_num_seqs={self.max_num_seqs}"
        if self.pad_sizes is None:
            return n
        return next(s for s in self.pad_sizes if s >= n)

    def _pad_rows(self, lo: int, hi: int) -> None:
        v = self.np
        v["input_ids"][lo:hi] = 0
        v["positions"][lo:hi] = 0
        v["slot_mapping"][lo:hi] = self.null_block * self.block_size
        v["context_lens"][lo:hi] = 1
        v["token_slots"][lo:hi] = -1
        v["block_tables"][lo:hi, 0] = self.null_block

    def stage(self, rows: Sequence[tuple[int, int, list[int], int]]) -> DecodeStep:
        """rows: per decode sequence, in batch order, (its new token id, that token's position,
        its block table, its LoRA slot or -1). Writes them (and the padding rows) into the
        buffers, copies them to the device, and returns the step's views."""
        n, bs = len(rows), self.block_size
        padded = self.padded_size(n)
        v = self.np
        ids, pos, slots, tables = (
            v["input_ids"],
            v["positions"],
            v["slot_mapping"],
            v["block_tables"],
        )
        lens, lora = v["context_lens"], v["token_slots"]
        max_blocks = 1
        for i, (token, p, table, slot) in enumerate(rows):
            blocks = p // bs + 1
            max_blocks = max(max_blocks, blocks)
            assert len(table) >= blocks and blocks <= self.width, (
                f"position {p} needs {blocks} blocks: table has {len(table)}, width {self.width}"
            )
            ids[i], pos[i], lens[i], lora[i] = token, p, p + 1, slot
            slots[i] = table[p // bs] * bs + p % bs
            tables[i, :blocks] = table[:blocks]
        if padded > n:
            self._pad_rows(n, padded)
        if self.dev is not self.host:
            # Safe to overwrite the pinned buffer next step: the engine reads this step's
            # sampled ids back on the same stream first, which orders after this copy.
            end = self._table_offset + 4 * padded * self.width
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
        return self.step_views(n, padded, max_blocks)

    def step_views(self, n: int, padded: int, max_blocks: int | None = None) -> DecodeStep:
        """The device views of a step of n rows padded to `padded` (as staged last);
        max_blocks None: the full width (what a captured graph must read)."""
        d = self.views
        return DecodeStep(
            num_seqs=n,
            padded=padded,
            input_ids=d["input_ids"][:padded],
            positions=d["positions"][:padded],
            slot_mapping=d["slot_mapping"][:padded],
            rows=self.rows[:padded],
            context_lens=d["context_lens"][:padded],
            token_slots=d["token_slots"][:padded],
            block_tables=d["block_tables"][:padded],
            max_blocks=self.width if max_blocks is None else max_blocks,
        )
