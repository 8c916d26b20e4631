"""Build a Scheduler without a model and drive it with hand-fed model outputs."""

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def create_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 512,
    max_loras: int = 2,
    lora_starvation_steps: int = 8,
    enable_prefix_caching: bool = False,  # off: make_seq gives every sequence the same tokens
) -> Scheduler:
    cfg = SchedulerConfig(
        max_num_seqs, max_num_batched_tokens, max_model_len, max_loras, lora_starvation_steps
    )
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching))


_LORAS: dict[str, LoRARequest] = {}


def lora(name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    if name not in _LORAS:
        _LORAS[name] = LoRARequest(name, len(_LORAS) + 1, f"/adapters/{name}")
    return _LORAS[name]


def make_seq(
    sched: Scheduler, req_id: str, prompt_len: int, max_tokens: int = 4, adapter: str | None = None
) -> Sequence:
    seq = Sequence(
        req_id,
        0,
        list(range(10, 10 + prompt_len)),
        SamplingParams(temperature=0, max_tokens=max_tokens),
        lora(adapter),
        sched.step_count,
        adapter_identity=None if adapter is None else f"weights-of-{adapter}",
    )
    sched.add(seq)
    return seq


def feed(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    """What the engine does after a forward: advance computed tokens, append one sampled token
    to every sequence that sampled, finish those that reached max_tokens. Returns finished."""
    sched.update_from_output(out)
    finished = []
    for s in out.scheduled:
        if s.sample:
            s.seq.token_ids.append(token)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
                finished.append(s.seq)
    return finished
