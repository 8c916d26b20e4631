"""Sequence: the unit the scheduler moves. A request with n > 1 owns n sequences."""

import enum
import itertools

import torch

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_counter = itertools.count()


class Sequence:
    """One token stream. No prefill/decode phase: num_computed_tokens catches up to num_tokens.

    A step schedules tokens [num_computed_tokens, num_computed_tokens + n); when that range
    ends at num_tokens the step samples the next token from the last position.
    """

    def __init__(
        self,
        req_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
        arrival_step: int,
        parent: "Sequence | None" = None,
        adapter_identity: str | None = None,
    ) -> None:
        if lora_request is not None and adapter_identity is None:
            # without it an adapter's blocks would be keyed like the base model's
            raise ValueError("a sequence with an adapter needs its adapter_identity")
        self.seq_id = next(_seq_counter)
        self.req_id = req_id
        self.index = index  # which of the request's n completions this is
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.lora_request = lora_request
        # Prefix caching: the adapter as loaded (LoRAManager: a content hash of its weights),
        # part of every block hash; None for the base model.
        self.adapter_identity = adapter_identity
        self.block_hashes: list[bytes] = []  # [num full blocks hashed so far], BlockManager's
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.arrival_step = arrival_step
        # Fan-out child: waits until `parent` has computed its full prompt blocks, then shares them.
        self.parent = parent
        self.first_scheduled_step: int | None = None
        self.num_slot_skips = 0  # steps skipped because its adapter had no slot (anti-starvation)
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []
        # Prompt logprobs: computed by the sequence that runs the whole prompt (index 0; fan-out
        # children share its blocks). k is fixed here, from the verified params. The list grows
        # as prefill chunks run (entry j: prompt token j) and is kept across a preemption, so
        # the recompute only fills what is missing.
        self.num_prompt_logprobs: int | None = params.prompt_logprobs if index == 0 else None
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if self.num_prompt_logprobs is not None else None
        )
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # folded into manual_seed's [0, 2**64); the same seed as before for small seeds
            seed = (params.seed * 1_000_003 + index) % 2**64
            self.generator = torch.Generator().manual_seed(seed)

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def prompt_logprob_positions(self, start: int, num_new_tokens: int) -> range:
        """Positions p in this step's [start, start + num_new_tokens) whose logits give a prompt
        logprob not yet known (that of prompt token p + 1)."""
        if self.prompt_logprobs is None:
            return range(0)
        done = len(self.prompt_logprobs) - 1  # positions [0, done) were already used
        end = self.num_prompt_tokens - 1  # the last prompt position predicts an output token
        assert start <= done or done == end, "this sequence skipped prompt positions"
        return range(max(start, done), min(start + num_new_tokens, end))

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.req_id}[{self.index}], "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, {self.status.name}, "
            f"lora={self.lora_name})"
        )
