"""Appends sampled tokens, detokenizes incrementally, applies stop rules, builds RequestOutputs."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.lora.request import LoRARequest
from engine.model_runner import ModelRunnerOutput
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampler import SampleResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def ids_decoder(tokenizer: Any) -> Callable[..., str]:
    """`decode(ids, skip_special_tokens=...)` for the detokenizer: a fast HF tokenizer's Rust
    `tokenizers.Tokenizer.decode` itself where HF's `decode` would return exactly its result
    (the stock `_decode`, no clean-up of tokenization spaces), else HF's `decode`. HF's
    wrapper costs ~8 us a call in Python (list conversion, kwargs, batching checks): two calls
    a token, 64 requests a step, ~1 ms of a GPU decode step that replays in 2-4 ms."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "_tokenizer", None)
    stock = (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer).decode is PreTrainedTokenizerFast.decode
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    )
    return backend.decode if stock and backend is not None else tokenizer.decode


class IncrementalDetokenizer:
    """vLLM-style: decode a short window of ids so each step costs O(1), and hold back text
    that ends in an incomplete UTF-8 sequence."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool,
        decode: Callable[..., str] | None = None,
    ) -> None:
        """decode: `ids_decoder(tokenizer)`, made once per engine (default: made here)."""
        self.tokenizer = tokenizer
        self.decode = decode or ids_decoder(tokenizer)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


@dataclass
class RequestState:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def make_output(self) -> RequestOutput:
        p = self.params
        hold = max((len(s) for s in p.stop_strs), default=1) - 1
        outputs = []
        for seq, det in zip(self.seqs, self.detoks, strict=True):
            text = det.text
            if hold and not seq.is_finished:  # don't show a stop string's beginning yet
                text = text[: max(0, len(text) - hold)]
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob if p.logprobs is not None else None,
                    logprobs=list(seq.logprobs) if p.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        first = self.seqs[0].prompt_logprobs  # the sequence that ran the whole prompt
        return RequestOutput(
            self.req_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            self.finished,
            self.lora_request,
            metrics,
            prompt_logprobs=list(first) if first is not None else None,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.decode = ids_decoder(tokenizer)  # for the requests' IncrementalDetokenizers
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.req_id] = state

    def process(
        self, out: SchedulerOutput, result: ModelRunnerOutput, scheduler: Scheduler
    ) -> list[RequestOutput]:
        """Apply one step's results; RequestOutputs of the requests that sampled, finished or
        failed. A request with a failed sequence fails whole (removed, finish_reason "error")."""
        failed: dict[str, str] = {}
        for s in out.scheduled:
            reason = result.failed.get(s.seq.seq_id)
            if reason is not None and s.seq.req_id in self.requests:
                failed.setdefault(s.seq.req_id, reason)
        outputs = [self.fail(req_id, reason, scheduler) for req_id, reason in failed.items()]
        for s in out.scheduled:  # before sampled tokens: a request's first output has them all
            entries = result.prompt_logprobs.get(s.seq.seq_id)
            if entries and not s.seq.is_finished:
                assert len(s.seq.prompt_logprobs) + len(entries) <= s.seq.num_prompt_tokens
                s.seq.prompt_logprobs.extend(entries)
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for s in out.scheduled:
            seq = s.seq
            sample = result.sampled.get(seq.seq_id)
            if sample is None or seq.is_finished:
                continue
            state = self.requests[seq.req_id]
            self._append(seq, state, sample, scheduler)
            if state.first_token_time is None:
                state.first_token_time = now
            touched[seq.req_id] = state
        for req_id, state in touched.items():
            outputs.append(state.make_output())
            if state.finished:
                del self.requests[req_id]
        return [o for o in outputs if o is not None]

    def fail(self, req_id: str, reason: str, scheduler: Scheduler) -> RequestOutput | None:
        """Remove a request the engine failed: its sequences finish with "error" (blocks freed)."""
        state = self.requests.pop(req_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            scheduler.finish(seq, "error")
        output = state.make_output()
        output.error = reason
        return output

    def _append(
        self, seq: Sequence, state: RequestState, r: SampleResult, scheduler: Scheduler
    ) -> None:
        p = seq.params
        seq.token_ids.append(r.token_id)
        if r.logprob is not None:
            seq.cumulative_logprob += r.logprob
            seq.logprobs.append(r.top_logprobs or {})
        det = state.detoks[seq.index]
        delta = det.add(r.token_id)
        if not p.ignore_eos and r.token_id in self.eos_token_ids:
            scheduler.finish(seq, "stop")
        elif p.stop_token_ids and r.token_id in p.stop_token_ids:
            scheduler.finish(seq, "stop", r.token_id)
        elif delta and (stop := self._find_stop_string(p, det, len(delta))) is not None:
            scheduler.finish(seq, "stop", stop)
        elif seq.num_tokens >= self.max_model_len or (
            p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens
        ):
            scheduler.finish(seq, "length")

    @staticmethod
    def _find_stop_string(
        p: SamplingParams, det: IncrementalDetokenizer, new_chars: int
    ) -> str | None:
        """If a stop string appeared in the new text, cut the text before it and return it."""
        for stop in p.stop_strs:
            start = max(0, len(det.text) - new_chars - len(stop) + 1)
            idx = det.text.find(stop, start)
            if idx != -1:
                det.text = det.text[:idx]
                return stop
        return None

    def abort(self, req_id: str, scheduler: Scheduler) -> RequestOutput | None:
        state = self.requests.pop(req_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            scheduler.finish(seq, "abort")
        return state.make_output()
