"""Paged KV cache bookkeeping: fixed-size blocks, reference counts for shared prompt blocks."""

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that seq can hold num_computed_tokens + num_new_tokens tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.num_blocks_needed(seq, num_new_tokens)):
            block_id = self.free_block_ids.popleft()
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def share_prefix(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """dst reuses src's first num_blocks (full, never written again) blocks."""
        assert not dst.block_table and num_blocks <= len(src.block_table)
        for block_id in src.block_table[:num_blocks]:
            self.ref_counts[block_id] += 1
            dst.block_table.append(block_id)
        dst.num_computed_tokens = num_blocks * self.block_size

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
