"""Adapter-aware scheduling: the max_loras bound, deferral, and the anti-starvation drain rule.

The property test drives the real engine (tiny model, real PEFT adapters) over random arrivals
and checks every invariant against a brute-force recount each step."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.model_runner import ModelRunnerOutput
from tests.lora_fixtures import make_peft_adapter
from tests.sched_utils import create_scheduler, feed, make_seq

NUM_ADAPTERS = 4


def test_request_without_slot_is_skipped_and_keeps_its_place():
    sched = create_scheduler(max_loras=1, max_num_batched_tokens=100)
    a = make_seq(sched, "a", 4, max_tokens=3, adapter="A")
    b = make_seq(sched, "b", 4, max_tokens=3, adapter="B")
    base = make_seq(sched, "base", 4, max_tokens=3)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, base]  # b skipped, base mixes in freely
    assert list(sched.waiting) == [b] and b.num_slot_skips == 1
    while a.status.name != "FINISHED":
        feed(sched, out)
        out = sched.schedule()
    # A's slot is free (A no longer running): b takes it, evicting A
    assert any(s.seq is b for s in out.scheduled)
    assert out.lora_loads[0][1].lora_name == "B" and sched.slots.num_evictions == 1


def test_drain_rule_bounds_the_wait_of_a_cold_adapter():
    """A and B keep arriving forever; C arrives once. Without the drain rule C would wait
    until the stream stops; with it, C is admitted within K + D + 1 steps."""
    K, max_tokens = 5, 6
    sched = create_scheduler(
        max_loras=2,
        max_num_seqs=8,
        max_num_batched_tokens=200,
        lora_starvation_steps=K,
        num_blocks=200,
        block_size=4,
    )
    c = None
    for step in range(120):
        for name in "AB":
            make_seq(sched, f"{name}{step}", 4, max_tokens=max_tokens, adapter=name)
        if step == 3:
            c = make_seq(sched, "C", 4, max_tokens=max_tokens, adapter="C")
        out = sched.schedule()
        assert len({s.seq.lora_name for s in out.scheduled} - {None}) <= 2
        feed(sched, out)
        if c is not None and c.first_scheduled_step is not None:
            break
    wait = c.first_scheduled_step - c.arrival_step
    D = 1 + max_tokens  # a running A/B request finishes within D steps
    assert wait <= K + D + 1, wait  # overdue after K steps, then the running A/B drain


def test_without_drain_the_cold_adapter_would_starve():
    """The same stream with the rule effectively off (huge K): C never gets in, which is the
    starvation the rule exists for (so the test above can fail)."""
    sched = create_scheduler(
        max_loras=2,
        max_num_seqs=8,
        max_num_batched_tokens=200,
        lora_starvation_steps=10**9,
        num_blocks=200,
        block_size=4,
    )
    c = None
    for step in range(60):
        for name in "AB":
            make_seq(sched, f"{name}{step}", 4, max_tokens=6, adapter=name)
        if step == 3:
            c = make_seq(sched, "C", 4, max_tokens=6, adapter="C")
        feed(sched, sched.schedule())
    assert c.first_scheduled_step is None


@pytest.fixture(scope="module")
def adapter_paths(tiny_model_dir, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("prop-adapters")
    return [
        str(
            make_peft_adapter(
                tiny_model_dir,
                root / f"a{i}",
                r=4,
                target_modules=["q_proj", "v_proj"],
                seed=i,
                std=0.1,
            )
        )
        for i in range(NUM_ADAPTERS)
    ]


arrival = st.tuples(
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, NUM_ADAPTERS - 1)),  # adapter (None = base)
    st.integers(1, 20),  # prompt length
    st.integers(1, 8),  # max_tokens
    st.integers(1, 2),  # n
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=14),
    max_loras=st.integers(1, 3),
    extra_cpu=st.integers(0, 2),
    budget=st.sampled_from([8, 16, 64]),
    max_num_seqs=st.integers(2, 8),
    num_kv_blocks=st.sampled_from([12, 24, 200]),
    starvation=st.integers(1, 6),
)
def test_property_random_arrivals(
    tiny_model_dir,
    adapter_paths,
    arrivals,
    max_loras,
    extra_cpu,
    budget,
    max_num_seqs,
    num_kv_blocks,
    starvation,
):
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            max_loras=max_loras,
            max_cpu_loras=max_loras + extra_cpu,
            max_lora_rank=8,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            num_kv_blocks=num_kv_blocks,
            block_size=4,
            lora_starvation_steps=starvation,
            max_model_len=48,
        )
    )
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapter_paths)]
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    seqs, finished, step = {}, set(), 0
    batches = {"steps": 0, "seqs": 0, "adapters": 0, "tokens": 0}  # stats()["steps"], recounted
    max_tokens_all = max(a[3] for a in arrivals)
    max_prompt = max(a[2] for a in arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, adapter, plen, max_tokens, n) = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(
                rid,
                {"prompt_token_ids": list(range(5, 5 + plen))},
                SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True),
                loras[adapter] if adapter is not None else None,
            )
            seqs[rid] = engine.output_processor.requests[rid].seqs
        out = engine.scheduler.schedule()
        # brute-force recount of the invariants
        in_batch = {s.seq.lora_name for s in out.scheduled} - {None}
        assert len(in_batch) <= max_loras
        running = {s.lora_name for s in engine.scheduler.running} - {None}
        assert len(running) <= max_loras
        assert all(out.lora_slots[name] < max_loras for name in in_batch)
        assert len(set(out.lora_slots.values())) == len(out.lora_slots)  # one slot each
        assert len(engine.scheduler.running) <= max_num_seqs
        assert out.num_batched_tokens <= budget
        if out.scheduled:
            batches["steps"] += 1
            batches["seqs"] += len(out.scheduled)
            batches["adapters"] += len(in_batch)
            batches["tokens"] += sum(s.num_new_tokens for s in out.scheduled)
        sampled = engine.model_runner.execute(out) if not out.is_empty else ModelRunnerOutput()
        engine.scheduler.update_from_output(out)
        for o in engine.output_processor.process(out, sampled, engine.scheduler):
            if o.finished:
                finished.add(o.request_id)
                assert all(
                    len(c.token_ids) == o.outputs[0].token_ids.__len__() or c.finish_reason
                    for c in o.outputs
                )
        step += 1
        assert step < 5000, "the engine stopped making progress"
    assert finished == set(seqs)  # every request finishes
    assert engine.stats()["steps"] == batches
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # no block leaks
    slots = engine.scheduler.slots
    assert len(slots.slot_of) <= max_loras and not engine.scheduler.adapters_in_use()
    assert len(engine.model_runner.lora_manager.cpu_cache) <= max_loras + extra_cpu
    # documented wait bound (engine/scheduler.py), when nothing was preempted
    if engine.scheduler.num_preemptions == 0 and budget >= max_num_seqs * max_prompt:
        D = max_tokens_all + 1
        bound = starvation + NUM_ADAPTERS * D + 1
        for rid, group in seqs.items():
            for s in group:
                assert s.first_scheduled_step - s.arrival_step <= bound, (
                    rid,
                    s.first_scheduled_step,
                    s.arrival_step,
                    bound,
                )
