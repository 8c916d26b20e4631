"""The scheduler: a CPU state machine over sequences, KV blocks and LoRA slots.

Each step:
1. Running sequences first (oldest first), each gets the tokens it still needs (1 for
   decode, a chunk for an unfinished prefill) within the token budget. If the KV cache
   cannot hold them, the newest running sequence is preempted (blocks freed, recomputed
   later) until it fits.
2. Then waiting sequences in arrival order, while there is budget, a free seat
   (max_num_seqs) and KV blocks. A waiting sequence whose adapter cannot get a slot is
   skipped and keeps its place; one that does not fit in the KV cache stops admission (so
   a long prompt is not overtaken forever).

Prefix caching (engine/block_manager.py): a waiting sequence with nothing computed (new, a
fan-out child, or preempted) first takes the prefix cache's hits as computed; the token budget
counts only the tokens it still computes. Fan-out children wait for their parent's full prompt
blocks and then find them in the cache (without caching they share them: share_prefix).
A waiting sequence whose next uncached block a running sequence is computing right now (a
burst of one tenant's requests: the same system prompt, the same adapter) waits for it
instead of computing it twice, and keeps its place; the others go past it meanwhile. The
wait lasts as long as that prefill (the holder is running, so it advances every step; a
preempted or aborted holder stops being one).

LoRA invariant: the distinct adapters among *running* sequences never exceed max_loras, so
the adapters of any step's batch never do either. Base requests (no adapter) never take a slot.

Anti-starvation (drain rule): a waiting adapter sequence that has been skipped for lack of a
slot at least once and has waited more than lora_starvation_steps steps since it arrived is
*overdue*. The adapter of the oldest overdue sequence becomes the *drain target*: no waiting
sequence of any other adapter is admitted (base requests still are). Running sequences of
other adapters run to completion, a slot frees, and the target gets it. Bound (without
preemption, with a token budget that lets every running sequence advance each step): a waiting
adapter request is first scheduled within
    lora_starvation_steps + (number of adapters drained before it + 1) * D + 1
steps of its arrival, where D is the most steps a running sequence needs to finish
(1 prefill step + max_tokens). tests/test_scheduler_lora.py checks it, and checks that without
the rule the same traffic starves the adapter.
"""

from collections import OrderedDict, deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.lora.request import LoRARequest
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens [seq.num_computed_tokens, + num_new_tokens) run this step
    sample: bool  # the range ends at seq.num_tokens: sample the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    lora_slots: dict[str, int] = field(default_factory=dict)  # adapter name -> slot, this step
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # fill before forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SlotTable:
    """Which adapter sits in which of the max_loras slots, least recently used first.

    Eviction: the idle adapter (no running sequence) with the lowest `priority(name)`, the
    least recently used among equals; without a priority, plain LRU (vLLM's). The replica
    sets priority to its decayed request counts per adapter (deployments/llm_server.py), so
    an adapter asked for once does not push out one asked for every second."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.priority: Callable[[str], float] | None = None
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.num_activations = 0
        self.num_evictions = 0
        self.num_hits = 0

    def acquire(self, lora: LoRARequest, in_use: set[str]) -> tuple[int, bool]:
        """Slot for lora (moving it to most recently used); True if its weights must be loaded."""
        name = lora.lora_name
        if name in self.slot_of:
            self.slot_of.move_to_end(name)
            self.num_hits += 1
            return self.slot_of[name], False
        taken = set(self.slot_of.values())
        free = [s for s in range(self.num_slots) if s not in taken]
        if free:
            slot = free[0]
        else:
            idle = [n for n in self.slot_of if n not in in_use]  # LRU first
            victim = idle[0] if self.priority is None else min(idle, key=self.priority)
            slot = self.slot_of.pop(victim)
            self.num_evictions += 1
        self.slot_of[name] = slot
        self.num_activations += 1
        return slot, True

    def evict(self, name: str) -> None:
        self.slot_of.pop(name, None)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.slots = SlotTable(config.max_loras)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        # over the steps that ran something: steps, sequences, adapters (LoRA groups of the
        # forward) and tokens, summed; their ratios are a batch's mean shape (stats()["steps"])
        self.num_batches = self.num_batch_seqs = self.num_batch_adapters = 0
        self.num_batch_tokens = 0

    # -- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish (or abort) a sequence wherever it is and free its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.deallocate(seq)

    def adapters_in_use(self) -> set[str]:
        return {s.lora_name for s in self.running if s.lora_name is not None}

    # -- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._assign_slots(out)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        if out.scheduled:
            self.num_batches += 1
            self.num_batch_seqs += len(out.scheduled)
            self.num_batch_adapters += len(out.lora_slots)
            self.num_batch_tokens += out.num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                self._add_scheduled(out, seq, n)
                budget -= n
                i += 1
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _drain_target(self) -> str | None:
        k = self.config.lora_starvation_steps
        overdue = [
            s
            for s in self.waiting
            if s.lora_name is not None
            and s.num_slot_skips > 0
            and self.step_count - s.arrival_step > k
        ]
        if not overdue:
            return None
        return min(overdue, key=lambda s: (s.arrival_step, s.seq_id)).lora_name

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        in_use = self.adapters_in_use()
        drain = self._drain_target()
        admitted: list[Sequence] = []
        caching = self.block_manager.enable_caching and self.waiting
        inflight = self._inflight_blocks() if caching else None  # not when nothing waits
        for seq in self.waiting:
            if budget <= 0 or len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            if seq.parent is not None and not self._parent_ready(seq):
                continue
            name = seq.lora_name
            if name is not None:
                blocked = drain is not None and name != drain
                if name not in in_use and len(in_use) >= self.config.max_loras:
                    blocked = True
                if blocked:
                    seq.num_slot_skips += 1
                    continue
            computed = None  # the prefix cache's hits, if it was looked up
            if seq.num_computed_tokens == 0 and not seq.block_table:
                if self.block_manager.enable_caching:
                    computed = self._computed_blocks(seq)
                elif seq.parent is not None:
                    self._share_parent_prefix(seq)
            if (
                inflight
                and computed is not None
                and self._next_block_inflight(seq, computed, inflight)
            ):
                continue
            num_hit = len(computed or ()) * self.block_manager.block_size
            n = min(seq.num_tokens - seq.num_computed_tokens - num_hit, budget)
            if not self.block_manager.can_allocate(seq, n, computed):
                if seq.parent is not None and seq.block_table:
                    self.block_manager.deallocate(seq)  # undo the share; retry next step
                break
            self.block_manager.allocate(seq, n, computed)
            if seq.first_scheduled_step is None:
                seq.num_cached_tokens = num_hit
            self._add_scheduled(out, seq, n)
            admitted.append(seq)
            budget -= n
            if inflight is not None:
                inflight.update(self._uncomputed_prompt_blocks(seq))
            if name is not None:
                in_use.add(name)
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_step is None:
                seq.first_scheduled_step = self.step_count
            self.running.append(seq)

    def _uncomputed_prompt_blocks(self, seq: Sequence) -> list[bytes]:
        """Hashes of seq's full prompt blocks it has not computed yet (its prefill to come)."""
        bs = self.block_manager.block_size
        num_full = seq.num_prompt_tokens // bs
        first = seq.num_computed_tokens // bs
        if first >= num_full:
            return []
        return self.block_manager.block_hashes(seq, num_full)[first:]

    def _inflight_blocks(self) -> set[bytes]:
        """The full prompt blocks running sequences are still prefilling."""
        out: set[bytes] = set()
        for seq in self.running:
            out.update(self._uncomputed_prompt_blocks(seq))
        return out

    def _next_block_inflight(self, seq: Sequence, computed: list[int], inflight: set) -> bool:
        """Is the first block seq would compute one a running sequence computes now? (Only
        blocks the cache could give it: full, and not the one holding its last token.)"""
        k = len(computed)
        if seq.parent is not None or k >= (seq.num_tokens - 1) // self.block_manager.block_size:
            return False
        return self.block_manager.block_hashes(seq, k + 1)[k] in inflight

    def _computed_blocks(self, seq: Sequence) -> list[int] | None:
        """The prefix cache's hits for seq; None: no lookup. A sequence computing prompt
        logprobs needs the logits of every prompt position it has not yet used, so it skips
        only positions whose logprobs it already holds (after a preemption), like vLLM's
        skip_reading_prefix_cache for a new one."""
        limit = None
        if seq.prompt_logprobs is not None:
            done = len(seq.prompt_logprobs) - 1  # positions [0, done) already used
            if done < seq.num_prompt_tokens - 1:
                if done < self.block_manager.block_size:
                    return None
                limit = done
        return self.block_manager.get_computed_blocks(seq, limit)

    def _parent_ready(self, seq: Sequence) -> bool:
        """A fan-out child waits until its parent computed the prompt's full blocks."""
        parent = seq.parent
        assert parent is not None
        if parent.status == SequenceStatus.FINISHED or seq.block_table:
            return True
        num_full = self._num_shared_blocks(seq)
        return (
            parent.status == SequenceStatus.RUNNING
            and parent.num_computed_tokens >= num_full * self.block_manager.block_size
        )

    def _share_parent_prefix(self, seq: Sequence) -> None:
        parent = seq.parent
        assert parent is not None
        if parent.status != SequenceStatus.RUNNING:
            return
        num_full = self._num_shared_blocks(seq)
        if num_full > 0:
            self.block_manager.share_prefix(parent, seq, num_full)

    def _num_shared_blocks(self, seq: Sequence) -> int:
        # Full prompt blocks only, and never the last prompt token: the child computes at
        # least that one itself so it samples its own first token.
        return (seq.num_prompt_tokens - 1) // self.block_manager.block_size

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        sample = seq.num_computed_tokens + n == seq.num_tokens
        out.scheduled.append(ScheduledSeq(seq, n, sample))

    def _assign_slots(self, out: SchedulerOutput) -> None:
        in_use = self.adapters_in_use()
        assert len(in_use) <= self.config.max_loras, (in_use, self.config.max_loras)
        for s in out.scheduled:
            lora = s.seq.lora_request
            if lora is None or lora.lora_name in out.lora_slots:
                continue
            slot, load = self.slots.acquire(lora, in_use)
            out.lora_slots[lora.lora_name] = slot
            if load:
                out.lora_loads.append((slot, lora))

    # -- after the forward ------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, failed: Container[int] = ()) -> None:
        """Advance num_computed_tokens for everything that ran (tokens are appended later) and
        put the blocks that are now full into the prefix cache, except those of the sequences
        in failed (seq_ids): a forward that raised may have left their KV half-written."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.seq.seq_id not in failed:
                self.block_manager.cache_full_blocks(s.seq)
