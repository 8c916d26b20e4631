"""BlockManager with prefix caching against a brute-force model (hypothesis, stateful).

The model keeps, independently of the manager, which sequences hold which blocks and what KV
each block holds: a block written full by a sequence holds (adapter identity, the token
prefix up to its end). After any sequence of admit (lookup + allocate), compute, decode, share,
free, preempt, allocation pressure and reset, it checks:
- reference counts equal the number of live block tables holding each block, the free list
  is exactly the unreferenced blocks (once each), unhashed ones ahead of hashed ones;
- hash -> block and block -> hash are inverse, and a hashed block's hash is the chained hash
  of the KV the model says it holds (so a hit serves the right prefix);
- a lookup returns the longest cached prefix the model knows of, each block holding exactly
  the looking-up sequence's (identity, prefix): never another adapter's or the base's;
- no live block is ever handed out again or loses its hash (other than by reset), and no
  tokens are ever written into a hashed or shared block.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_manager import BlockManager, hash_block_tokens
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

NUM_BLOCKS, BS = 10, 2
IDENTITIES = [None, "A", "B"]  # the base model and two adapters' weights
PARAMS = SamplingParams(temperature=0, max_tokens=100)

pytestmark = pytest.mark.timeout(240)


def chain_hash(identity: str | None, tokens: tuple[int, ...]) -> bytes:
    h = None
    for i in range(0, len(tokens), BS):
        h = hash_block_tokens(h, tokens[i : i + BS], identity)
    return h


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_caching=True)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        # block id -> (identity, prefix tokens) of a block written full; ("partial",) otherwise
        self.content: dict[int, tuple] = {}

    # -- helpers ------------------------------------------------------------------------
    def _new_seq(self, tokens: list[int], identity: str | None) -> Sequence:
        # only the identity reaches the block manager; the LoRARequest does not
        return Sequence("r", 0, tokens, PARAMS, None, 0, adapter_identity=identity)

    def _model_refs(self) -> list[int]:
        refs = [0] * NUM_BLOCKS
        for seq in self.running:
            for b in seq.block_table:
                refs[b] += 1
        return refs

    def _live_hashed(self) -> dict[int, bytes]:
        refs = self._model_refs()
        return {
            b: self.bm.block_hash[b]
            for b in range(NUM_BLOCKS)
            if refs[b] and self.bm.block_hash[b] is not None
        }

    def _expected_hits(self, seq: Sequence) -> int:
        """Brute force: the longest k <= (num_tokens - 1) // BS whose prefixes all sit in
        hashed blocks (by the model's record of their content)."""
        held = {self.content.get(b) for b in range(NUM_BLOCKS) if self.bm.block_hash[b]}
        k = 0
        while (k + 1) * BS <= seq.num_tokens - 1:
            if (seq.adapter_identity, tuple(seq.token_ids[: (k + 1) * BS])) not in held:
                break
            k += 1
        return k

    def _allocate(self, seq: Sequence, n: int, computed: list[int] | None) -> bool:
        refs_before = self._model_refs()
        live_before = self._live_hashed()
        if not self.bm.can_allocate(seq, n, computed):
            assert self.bm.num_blocks_needed(seq, n, computed) > self.bm.num_free_blocks
            return False
        old = list(seq.block_table)
        self.bm.allocate(seq, n, computed)
        new = seq.block_table[len(old) + len(computed or ()) :]
        # fresh blocks were unreferenced, distinct, and not among the hits
        assert all(refs_before[b] == 0 for b in new), "a live block was handed out again"
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in new:
            self.content[b] = ("partial",)
        for b, h in live_before.items():
            assert self.bm.block_hash[b] == h, "a live block lost its hash"
        assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
        return True

    def _compute(self, seq: Sequence, n: int, register: bool) -> None:
        """The forward writes tokens [num_computed_tokens, + n), then update_from_output."""
        refs = self._model_refs()
        start = seq.num_computed_tokens
        for p in range(start, start + n):
            b = seq.block_table[p // BS]
            assert self.bm.block_hash[b] is None, "tokens written into a cached block"
            assert refs[b] == 1, "tokens written into a shared block"
        for i in range(start // BS, (start + n) // BS):
            self.content[seq.block_table[i]] = (
                seq.adapter_identity,
                tuple(seq.token_ids[: (i + 1) * BS]),
            )
        seq.num_computed_tokens += n
        if register:
            self.bm.cache_full_blocks(seq)

    # -- rules --------------------------------------------------------------------------
    @rule(
        prefix=st.sampled_from([[], [1, 2], [1, 2, 3, 4], [5, 6, 7, 8]]),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=5),
        identity=st.sampled_from(IDENTITIES),
    )
    def add(self, prefix, tail, identity):
        if len(self.waiting) < 6:
            self.waiting.append(self._new_seq(prefix + tail, identity))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), lookup=st.booleans(), register=st.booleans())
    def admit(self, data, lookup, register):
        seq = data.draw(st.sampled_from(self.waiting))
        computed = self.bm.get_computed_blocks(seq) if lookup else None
        if computed is not None:
            assert len(computed) == self._expected_hits(seq)
            assert len(computed) * BS <= seq.num_tokens - 1  # the last token always runs
            for i, b in enumerate(computed):
                assert self.content[b] == (
                    seq.adapter_identity,
                    tuple(seq.token_ids[: (i + 1) * BS]),
                )
        remaining = seq.num_tokens - len(computed or ()) * BS
        n = data.draw(st.integers(1, remaining))
        if self._allocate(seq, n, computed):
            self.waiting.remove(seq)
            self.running.append(seq)
            self._compute(seq, n, register)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), register=st.booleans(), decode_token=st.integers(1, 3))
    def step(self, data, register, decode_token):
        """A prefill chunk, or (when caught up) a sampled token and its decode step."""
        seq = data.draw(st.sampled_from(self.running))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(decode_token)
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        if self._allocate(seq, n, None):
            self._compute(seq, n, register)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tail=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def share(self, data, tail):
        """A fan-out child takes the first k full computed blocks of a running sequence."""
        src = data.draw(st.sampled_from(self.running))
        k = data.draw(st.integers(0, src.num_computed_tokens // BS))
        child = self._new_seq(src.token_ids[: k * BS] + tail, src.adapter_identity)
        self.bm.share_prefix(src, child, k)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.bm.deallocate(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        """Recompute preemption: blocks freed (kept cached), tokens kept, back to waiting."""
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.bm.deallocate(seq)
        assert seq.num_computed_tokens == 0 and not seq.block_table
        self.waiting.append(seq)

    @rule(n=st.integers(1, NUM_BLOCKS * BS))
    def pressure(self, n):
        """Allocation pressure: a throwaway sequence takes free blocks (evicting cached ones)."""
        seq = self._new_seq([9] * n, None)
        if self._allocate(seq, n, None):
            self.running.append(seq)
            self._compute(seq, n, register=False)

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()
        assert self.bm.num_cached_blocks == 0

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self):
        bm = self.bm
        refs = self._model_refs()
        assert bm.ref_counts == refs
        free = list(bm.free_block_ids)
        assert len(free) == len(set(free)) and set(free) == {
            b for b in range(NUM_BLOCKS) if not refs[b]
        }
        hashed = [bm.block_hash[b] is not None for b in free]
        assert hashed == sorted(hashed), "an unhashed free block behind a hashed one"
        assert {b: h for h, b in bm.cached_block_ids.items()} == {
            b: h for b, h in enumerate(bm.block_hash) if h is not None
        }
        for b, h in enumerate(bm.block_hash):
            if h is not None:
                identity, tokens = self.content[b]
                assert len(tokens) % BS == 0 and h == chain_hash(identity, tokens)
        for seq in self.running:
            assert seq.num_computed_tokens <= len(seq.block_table) * BS
        assert set(bm.num_cached_block) <= {s.seq_id for s in self.running}

    def teardown(self):
        for seq in self.running:
            self.bm.deallocate(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS and not any(self.bm.ref_counts)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_against_brute_force = BlockManagerMachine.TestCase
