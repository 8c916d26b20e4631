"""The scheduler as a CPU state machine: token budget, max_num_seqs, chunked prefill,
preemption and resume, block accounting."""

from engine.sequence import SequenceStatus
from tests.sched_utils import create_scheduler, feed, make_seq


def test_token_budget_and_chunked_prefill():
    sched = create_scheduler(max_num_batched_tokens=32, block_size=4)
    a = make_seq(sched, "a", prompt_len=50)
    b = make_seq(sched, "b", prompt_len=10)
    out = sched.schedule()
    # a takes the whole budget as a 32-token chunk; b waits
    assert [(s.seq.req_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 32, False)]
    assert out.num_batched_tokens == 32
    feed(sched, out)
    out = sched.schedule()
    # a's remaining 18 tokens (samples), then b's 10 tokens fill the rest (14 left, 10 needed)
    assert [(s.seq.req_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        ("a", 18, True),
        ("b", 10, True),
    ]
    feed(sched, out)
    out = sched.schedule()  # both decode now: one token each
    assert [(s.seq.req_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert a.num_computed_tokens == 51 - 1 and b.num_computed_tokens == 11 - 1


def test_max_num_seqs_limits_running():
    sched = create_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    seqs = [make_seq(sched, f"r{i}", prompt_len=5) for i in range(5)]
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert len(sched.running) == 2 and len(sched.waiting) == 3


def test_decode_and_prefill_share_a_step():
    sched = create_scheduler(max_num_batched_tokens=20)
    a = make_seq(sched, "a", prompt_len=8, max_tokens=10)
    feed(sched, sched.schedule())
    b = make_seq(sched, "b", prompt_len=30)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 19)]


def test_preemption_by_recompute_and_resume():
    # 6 blocks of 4 tokens = 24 token slots; two sequences of 10 + growth must collide
    sched = create_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=100)
    a = make_seq(sched, "a", prompt_len=10, max_tokens=10)
    b = make_seq(sched, "b", prompt_len=10, max_tokens=10)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.block_manager.num_free_blocks == 0
    feed(sched, out)
    # both need a 4th block for token 12 soon; the newest (b) gets preempted
    preempted_at = None
    for step in range(10):
        out = sched.schedule()
        if out.preempted:
            preempted_at = step
            assert out.preempted == [b]
            assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
            assert b.block_table == [] and sched.waiting[0] is b
            assert all(s.seq is a for s in out.scheduled)
            break
        feed(sched, out)
    assert preempted_at is not None
    # a runs to completion; then b resumes and recomputes prompt + its generated tokens
    b_tokens = b.num_tokens
    while a.status != SequenceStatus.FINISHED:
        feed(sched, sched.schedule())
    out = sched.schedule()
    assert out.scheduled[0].seq is b and out.scheduled[0].num_new_tokens == b_tokens
    while sched.has_unfinished():
        feed(sched, sched.schedule())
    assert b.num_output_tokens == 10
    assert sched.block_manager.num_free_blocks == 6


def test_running_sequence_preempts_itself_when_alone_and_too_big_waits():
    sched = create_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=100)
    a = make_seq(sched, "a", prompt_len=7, max_tokens=5)  # needs 3 blocks to finish
    feed(sched, sched.schedule())
    out = sched.schedule()  # token 8 fits in block 2
    feed(sched, out)
    out = sched.schedule()  # token 9 needs a 3rd block: it preempts itself
    assert out.preempted == [a] and not out.scheduled
    assert sched.block_manager.num_free_blocks == 2


def test_abort_frees_blocks_everywhere():
    sched = create_scheduler(num_blocks=10, block_size=4)
    a = make_seq(sched, "a", prompt_len=9)
    b = make_seq(sched, "b", prompt_len=9)
    feed(sched, sched.schedule())
    c = make_seq(sched, "c", prompt_len=3)
    for seq in (a, b, c):
        sched.finish(seq, "abort")
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 10
