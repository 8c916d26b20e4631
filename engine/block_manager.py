"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, automatic prefix caching.

Prefix caching (vLLM's automatic prefix caching, on with enable_prefix_caching). A block that
is full and whose KV has been computed is registered under its block hash, a chained hash of
    (the previous block's hash, the block's token ids, the adapter identity)
so a hash names the whole prefix up to the block's end, under one adapter as loaded (a content
hash of its weights, engine/lora/manager.py; None for the base model). Requests of different
adapters, or of an adapter and the base, never share a block; an adapter reloaded with other
weights under the same name gets other hashes. A sequence admitted with nothing computed (new
or preempted) takes the longest run of its leading blocks found in the cache and starts
computing after it, never at its last token: that token's logits give the next token.

A block is in one of two states:
  live: ref_count > 0, in the block_table of ref_count sequences. Never evicted; once it has
        a hash it is never written again (new tokens go past num_computed_tokens).
  free: ref_count == 0, in free_block_ids. A free block keeps its hash (and KV) until it is
        allocated again: a lookup until then revives it.
free_block_ids is the eviction order, head first: blocks without a hash (nothing to keep),
then hashed blocks least recently freed first. A sequence frees its blocks last one first,
so a prefix's tail is evicted before its head (vLLM's order).
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from engine.sequence import Sequence

BlockHash = bytes  # sha256 digest, 32 bytes


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Tokens[int], adapter_identity: str | None
) -> BlockHash:
    """The chained hash of one full block. sha256, not Python's hash(): a collision would
    hand one prompt another prompt's KV."""
    h = hashlib.sha256(parent if parent is not None else b"\0" * 32)
    ident = b"" if adapter_identity is None else b"lora:" + adapter_identity.encode()
    h.update(len(ident).to_bytes(4, "little") + ident)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counted in tokens, per lookup (vLLM's prefix_cache_queries / prefix_cache_hits): a
    lookup is a sequence's admission with nothing computed (new, fan-out child, or preempted)."""

    num_queries: int = 0  # the looking-up sequences' num_tokens
    num_hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[BlockHash | None] = [None] * num_blocks  # block id -> its hash
        self.cached_block_ids: dict[BlockHash, int] = {}  # hash -> the one block holding it
        # seq_id -> how many leading blocks of its block_table cache_full_blocks has seen
        self.num_cached_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()
        self.num_evictions = 0  # hashed blocks reallocated (their KV dropped)

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate can hand out, cached free blocks included."""
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_ids)

    # -- lookup -----------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The hashes of seq's first num_blocks full blocks (computed once, kept on seq)."""
        hashes, bs = seq.block_hashes, self.block_size
        assert num_blocks * bs <= seq.num_tokens
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            hashes.append(hash_block_tokens(parent, tokens, seq.adapter_identity))
        return hashes[:num_blocks]

    def get_computed_blocks(self, seq: Sequence, max_num_tokens: int | None = None) -> list[int]:
        """The longest run of seq's leading blocks in the cache, at most max_num_tokens
        (default and cap: num_tokens - 1, so the last token is always computed). Read-only:
        pass the result to can_allocate / allocate."""
        if not self.enable_caching:
            return []
        limit = seq.num_tokens - 1
        if max_num_tokens is not None:
            limit = min(limit, max_num_tokens)
        blocks = []
        for h in self.block_hashes(seq, max(0, limit) // self.block_size):
            block_id = self.cached_block_ids.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    # -- allocation -------------------------------------------------------------------
    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> int:
        """Free blocks that allocate(seq, num_new_tokens, computed_blocks) takes: new blocks so
        that seq holds its computed tokens + num_new_tokens, plus the free cached blocks it
        revives."""
        num_computed = len(computed_blocks or ())
        total = seq.num_computed_tokens + num_computed * self.block_size + num_new_tokens
        have = len(seq.block_table) + num_computed
        revived = sum(self.ref_counts[b] == 0 for b in computed_blocks or ())
        return max(0, -(-total // self.block_size) - have) + revived

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, computed_blocks) <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> None:
        """Room for num_new_tokens more tokens. computed_blocks (from get_computed_blocks, for a
        sequence with nothing computed): the lookup's hits, which seq takes as computed
        (num_computed_tokens advances past them) and which the stats count; None: no lookup."""
        if computed_blocks is not None:
            assert not seq.block_table and seq.num_computed_tokens == 0, seq
            self.stats.num_queries += seq.num_tokens
            self.stats.num_hits += len(computed_blocks) * self.block_size
            for block_id in computed_blocks:
                assert self.block_hash[block_id] is not None
                if self.ref_counts[block_id] == 0:
                    del self.free_block_ids[block_id]
                self.ref_counts[block_id] += 1
                seq.block_table.append(block_id)
            seq.num_computed_tokens = len(computed_blocks) * self.block_size
            self.num_cached_block[seq.seq_id] = len(computed_blocks)
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(max(0, -(-total // self.block_size) - len(seq.block_table))):
            block_id, _ = self.free_block_ids.popitem(last=False)
            assert self.ref_counts[block_id] == 0
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            assert self.cached_block_ids[h] == block_id
            del self.cached_block_ids[h]
            self.block_hash[block_id] = None
            self.num_evictions += 1

    def share_prefix(self, src: Sequence, dst: Sequence, num_blocks: int) -> None:
        """dst reuses src's first num_blocks (full, never written again) blocks. The fan-out
        path without prefix caching; with it, children find the parent's blocks by lookup."""
        assert not dst.block_table and num_blocks <= len(src.block_table)
        for block_id in src.block_table[:num_blocks]:
            self.ref_counts[block_id] += 1
            dst.block_table.append(block_id)
        dst.num_computed_tokens = num_blocks * self.block_size
        self.num_cached_block[dst.seq_id] = num_blocks

    # -- after a forward ----------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are now full and computed (call once their KV is written:
        after a forward that succeeded). A block whose hash another block already holds stays
        unregistered (one block per hash) and is freed without a hash."""
        if not self.enable_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        start = self.num_cached_block.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(start, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if self.block_hash[block_id] is not None:
                assert self.block_hash[block_id] == h  # a hit (or shared) block: same prefix
            elif h not in self.cached_block_ids:
                self.block_hash[block_id] = h
                self.cached_block_ids[h] = block_id
        self.num_cached_block[seq.seq_id] = num_full

    # -- freeing ------------------------------------------------------------------------
    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
                if self.block_hash[block_id] is None:  # nothing to keep: reallocated first
                    self.free_block_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_cached_block.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (vLLM's reset_prefix_cache); live blocks stay with their
        sequences. Returns the number of hashes dropped."""
        num = len(self.cached_block_ids)
        for block_id in self.cached_block_ids.values():
            self.block_hash[block_id] = None
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.move_to_end(block_id, last=False)
        self.cached_block_ids.clear()
        return num
