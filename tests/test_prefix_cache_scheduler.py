"""Prefix caching in the scheduler, a CPU state machine fed by hand: hits, the token budget,
the last prompt token, adapter isolation, fan-out, preemption, prompt logprobs, failed steps,
LRU eviction, and the counters (num_cached_tokens, queries / hits), all counted by hand."""

import pytest

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from tests.sched_utils import create_scheduler, feed, lora

pytestmark = pytest.mark.timeout(60)

BS = 4


def sched_with_cache(**kw) -> Scheduler:
    kw = {"block_size": BS, "max_num_batched_tokens": 64} | kw
    return create_scheduler(enable_prefix_caching=True, **kw)


def add(
    sched: Scheduler,
    req_id: str,
    tokens: list[int],
    adapter: str | None = None,
    max_tokens: int = 2,
    identity: str | None = None,
    **params,
) -> Sequence:
    if adapter is not None and identity is None:
        identity = f"weights-of-{adapter}"
    seq = Sequence(
        req_id,
        0,
        tokens,
        SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        lora(adapter),
        sched.step_count,
        adapter_identity=identity,
    )
    sched.add(seq)
    return seq


def run_to_end(sched: Scheduler) -> None:
    while sched.has_unfinished():
        feed(sched, sched.schedule())


def scheduled(out) -> list[tuple[str, int, bool]]:
    return [(s.seq.req_id, s.num_new_tokens, s.sample) for s in out.scheduled]


SYSTEM = list(range(100, 108))  # two full blocks


def test_hit_counts_and_budget_by_hand():
    sched = sched_with_cache()
    a = add(sched, "a", SYSTEM + [1, 2])  # 10 tokens: blocks [0:4] [4:8] full, [8:10] not
    out = sched.schedule()
    assert scheduled(out) == [("a", 10, True)] and a.num_cached_tokens == 0
    feed(sched, out)
    bm = sched.block_manager
    assert bm.num_cached_blocks == 2  # only the full, computed blocks
    b = add(sched, "b", SYSTEM + [3, 4, 5])  # 11 tokens, shares a's two full blocks
    out = sched.schedule()
    # b computes only its 3 new tokens: the budget and num_batched_tokens count those
    assert ("b", 3, True) in scheduled(out) and out.num_batched_tokens == 1 + 3
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    # vLLM's counters, in tokens: each lookup queries its num_tokens
    assert (bm.stats.num_queries, bm.stats.num_hits) == (10 + 11, 0 + 8)
    assert bm.stats.hit_rate == pytest.approx(8 / 21)
    run_to_end(sched)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert bm.num_cached_blocks >= 2  # freed blocks stay cached


def test_budget_left_by_a_hit_admits_more():
    sched = sched_with_cache(max_num_batched_tokens=20)
    a = add(sched, "a", list(range(200, 220)))  # 20 tokens, the whole budget
    feed(sched, sched.schedule())
    sched.finish(a, "abort")
    b = add(sched, "b", list(range(200, 220)))  # same 20 tokens: 4 blocks hit, 4 tokens left
    add(sched, "c", list(range(300, 316)))  # 16 new tokens
    out = sched.schedule()
    assert scheduled(out) == [("b", 4, True), ("c", 16, True)]
    assert out.num_batched_tokens == 20 and b.num_cached_tokens == 16


def test_block_multiple_prompt_still_computes_its_last_block():
    sched = sched_with_cache()
    a = add(sched, "a", SYSTEM)  # 8 tokens = exactly two blocks
    feed(sched, sched.schedule())
    a_blocks = list(a.block_table)
    run_to_end(sched)
    b = add(sched, "b", SYSTEM)
    out = sched.schedule()
    # all 8 tokens are cached but the last one must run to give logits: the second block is
    # recomputed (into a fresh block: a hashed block is never written again)
    assert scheduled(out) == [("b", 4, True)] and b.num_cached_tokens == 4
    assert b.block_table[0] == a_blocks[0] and b.block_table[1] != a_blocks[1]
    feed(sched, out)
    assert b.num_output_tokens == 1


@pytest.mark.parametrize(
    "first, second",
    [("A", "B"), ("A", None), (None, "A")],
    ids=["adapter-adapter", "adapter-base", "base-adapter"],
)
def test_no_block_shared_across_adapters_or_with_base(first, second):
    sched = sched_with_cache()
    a = add(sched, "a", SYSTEM * 3, adapter=first)
    feed(sched, sched.schedule())
    a_blocks = set(a.block_table)
    run_to_end(sched)
    assert sched.block_manager.num_cached_blocks == 6
    b = add(sched, "b", SYSTEM * 3, adapter=second)
    out = sched.schedule()
    assert scheduled(out) == [("b", 24, True)] and b.num_cached_tokens == 0
    assert not set(b.block_table) & a_blocks
    # the same adapter identity does hit
    c = add(sched, "c", SYSTEM * 3, adapter=first)
    feed(sched, out)
    out = sched.schedule()
    assert c.num_cached_tokens == 20


def test_adapter_identity_not_name_keys_the_blocks():
    """Same name, other weights (a reload): no hit. Another name, the same weights: a hit."""
    sched = sched_with_cache()
    add(sched, "a", SYSTEM * 2, adapter="x", identity="sha-1")
    run_to_end(sched)
    b = add(sched, "b", SYSTEM * 2, adapter="x", identity="sha-2")
    feed(sched, sched.schedule())
    assert b.num_cached_tokens == 0
    c = add(sched, "c", SYSTEM * 2, adapter="y", identity="sha-1")
    feed(sched, sched.schedule())
    assert c.num_cached_tokens == 12


def test_fan_out_children_find_the_parent_blocks():
    sched = sched_with_cache()
    tokens = list(range(50, 71))  # 21 tokens: 5 full blocks + 1
    params = SamplingParams(n=3, temperature=0, max_tokens=2)
    parent = Sequence("r", 0, tokens, params, None, 0)
    kids = [Sequence("r", i, tokens, params, None, 0, parent=parent) for i in (1, 2)]
    for s in [parent, *kids]:
        sched.add(s)
    out = sched.schedule()
    assert scheduled(out) == [("r", 21, True)]  # children wait for the parent's blocks
    feed(sched, out)
    out = sched.schedule()
    assert scheduled(out) == [("r", 1, True)] * 3  # the parent decodes, children 1 token each
    bm = sched.block_manager
    assert all(bm.ref_counts[b] == 3 for b in parent.block_table[:5])
    assert parent.num_cached_tokens == 0 and [k.num_cached_tokens for k in kids] == [20, 20]
    assert (bm.stats.num_queries, bm.stats.num_hits) == (21 * 3, 40)
    run_to_end(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_sequence_finds_its_own_blocks():
    # 6 blocks of 4: a (10 tokens) and b (10 tokens) take 3 each; decode makes them collide
    sched = sched_with_cache(num_blocks=6)
    a = add(sched, "a", list(range(10, 20)), max_tokens=6)  # 16 tokens: 4 blocks at most
    b = add(sched, "b", list(range(30, 40)), max_tokens=8)
    feed(sched, sched.schedule())
    for _ in range(4):
        out = sched.schedule()
        if out.preempted:
            break
        feed(sched, out)
    assert out.preempted == [b] and b.status == SequenceStatus.WAITING
    feed(sched, out)
    queries, hits = sched.block_manager.stats.num_queries, sched.block_manager.stats.num_hits
    # b's three blocks were freed as cached, last one first; a's one more block takes b's
    # last (LRU order), so b finds its first two
    while a.status != SequenceStatus.FINISHED:
        feed(sched, sched.schedule())
    num_tokens = b.num_tokens
    out = sched.schedule()
    assert out.scheduled[0].seq is b
    hit = sched.block_manager.stats.num_hits - hits
    assert hit == 8 and out.scheduled[0].num_new_tokens == num_tokens - hit
    assert sched.block_manager.stats.num_queries - queries == num_tokens
    assert b.num_cached_tokens == 0  # set at the first admission only (vLLM)
    run_to_end(sched)
    assert b.num_output_tokens == 8


def test_prompt_logprobs_request_computes_every_position():
    sched = sched_with_cache()
    add(sched, "a", SYSTEM * 2)
    run_to_end(sched)
    stats = sched.block_manager.stats
    before = (stats.num_queries, stats.num_hits)
    b = add(sched, "b", SYSTEM * 2, prompt_logprobs=0)
    out = sched.schedule()
    assert scheduled(out) == [("b", 16, True)] and b.num_cached_tokens == 0
    assert (stats.num_queries, stats.num_hits) == before  # no lookup, not counted (vLLM)


def test_preempted_prompt_logprobs_request_skips_only_what_it_has():
    sched = sched_with_cache()
    add(sched, "a", SYSTEM * 2)
    run_to_end(sched)
    b = add(sched, "b", SYSTEM * 2, prompt_logprobs=0)
    # as after a preemption mid-prefill: positions [0, 5) used, entries for tokens 0..5
    b.prompt_logprobs = [None] + [{1: 0.0}] * 5
    out = sched.schedule()
    assert scheduled(out) == [("b", 12, True)]  # one block (4 <= 5 positions) from the cache
    assert b.prompt_logprob_positions(b.num_computed_tokens, 12) == range(5, 15)


def test_failed_step_registers_nothing():
    sched = sched_with_cache()
    a = add(sched, "a", SYSTEM * 2)
    out = sched.schedule()
    sched.update_from_output(out, failed={a.seq_id})
    assert sched.block_manager.num_cached_blocks == 0
    sched.finish(a, "error")
    b = add(sched, "b", SYSTEM * 2)
    feed(sched, sched.schedule())
    assert b.num_cached_tokens == 0


def test_cached_blocks_evicted_least_recently_freed_first():
    sched = sched_with_cache(num_blocks=6)
    p1, p2 = list(range(10, 18)), list(range(20, 28))  # two blocks each, fully cacheable
    for rid, p in (("a", p1 + [1]), ("b", p2 + [1])):
        add(sched, rid, p)
        run_to_end(sched)
    assert sched.block_manager.num_cached_blocks == 4
    # 3 blocks of new tokens: the 2 unhashed free blocks go first, then p1's tail (freed
    # before p2's blocks); p1's head and p2 stay
    add(sched, "c", list(range(40, 51)), max_tokens=1)
    run_to_end(sched)
    d = add(sched, "d", p2 + [2])
    e = add(sched, "e", p1 + [2])
    feed(sched, sched.schedule())
    assert d.num_cached_tokens == 8 and e.num_cached_tokens == 4


def test_without_prefix_caching_nothing_is_looked_up():
    cfg = SchedulerConfig(8, 64, 512, 2, 8)
    sched = Scheduler(cfg, BlockManager(64, BS, enable_caching=False))
    add(sched, "a", SYSTEM * 2)
    run_to_end(sched)
    b = add(sched, "b", SYSTEM * 2)
    out = sched.schedule()
    assert scheduled(out) == [("b", 16, True)] and b.num_cached_tokens == 0
    bm = sched.block_manager
    assert bm.num_cached_blocks == 0 and bm.stats.num_queries == 0


def test_a_burst_computes_a_shared_prefix_once():
    """Two requests with one system prompt arrive together: the second waits while the first
    computes the shared blocks (it would compute them too, in the same step), keeps its
    place, and then finds them; a request of another tenant, or the same prompt under
    another adapter, goes past it meanwhile. The holder spreads over two steps (chunked
    prefill): the wait lasts both."""
    sched = sched_with_cache(max_num_batched_tokens=13)
    long_system = SYSTEM + list(range(200, 208))  # four full blocks
    add(sched, "a", long_system + [1, 2])  # 18 tokens: 13 now, 5 next step
    b = add(sched, "b", long_system + [3])  # same tenant
    c = add(sched, "c", long_system + [4], adapter="x")  # same text, another adapter
    out = sched.schedule()
    assert scheduled(out) == [("a", 13, False)]  # budget spent: c could not fit anyway
    feed(sched, out)
    out = sched.schedule()
    # a's last 6 tokens; b still waits for a's 4th block; c has nothing to wait for
    assert scheduled(out) == [("a", 5, True), ("c", 8, False)]
    assert b.status == SequenceStatus.WAITING and c.num_cached_tokens == 0
    feed(sched, out)
    out = sched.schedule()
    assert scheduled(out) == [("a", 1, True), ("c", 9, True), ("b", 1, True)]
    assert b.num_cached_tokens == 16
    run_to_end(sched)
    bm = sched.block_manager
    assert bm.stats.num_hits == 16  # b's four blocks, once; a and c computed theirs


def test_the_wait_ends_when_the_holder_is_preempted_or_aborted():
    """A holder that stops (aborted here; a preempted one leaves `running` the same way)
    stops being waited for: the waiting request computes the blocks itself."""
    sched = sched_with_cache(max_num_batched_tokens=8)
    long_system = SYSTEM + list(range(200, 208))
    a = add(sched, "a", long_system + [1, 2])
    b = add(sched, "b", long_system + [3])
    feed(sched, sched.schedule())  # a: 8 of 18 tokens
    sched.finish(a, "abort")
    out = sched.schedule()
    assert [r for r, *_ in scheduled(out)] == ["b"] and b.num_cached_tokens == 8
