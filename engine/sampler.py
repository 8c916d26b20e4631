"""Sampling from the last-position logits of the sequences that sample this step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.structured import StructuredOutputManager


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # of the sampled token under the model's (raw) distribution
    top_logprobs: dict[int, float] | None  # token id -> logprob, sampled token included


class Sampler:
    def __init__(
        self, seed: int = 0, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests
        # torch.argmax(logits, -1) for greedy rows: the C++ one on the CPU (csrc/sample_cpu.cpp,
        # the same ids, vectorised), else torch's
        self.argmax = argmax or (lambda x: x.argmax(dim=-1))
        # Set by LLMEngine (it needs the tokenizer): the grammars of constrained sequences.
        self.structured: StructuredOutputManager | None = None

    def sample_isolated(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[SampleResult | None], list[str | None]]:
        """Like __call__, but with structured outputs, and a row that fails fails alone:
        (results, errors), row i has one of the two.

        Constrained rows first get their grammar's token bitmask (logits of disallowed tokens
        -inf, in place, in this same batch; logprobs are then those of the masked
        distribution, as in vLLM), and after sampling their grammar accepts the token. A row
        whose matcher fails, or whose grammar refuses its token, fails alone."""
        logits = logits.float()
        errors: list[str | None] = [None] * len(seqs)
        if self.structured is not None:
            errors = self.structured.apply_bitmask(logits, seqs)
        rows = [i for i, e in enumerate(errors) if e is None]
        results: list[SampleResult | None] = [None] * len(seqs)
        if rows:
            sub = logits if len(rows) == len(seqs) else logits[rows]
            sampled, failed = self._sample_rows(sub, [seqs[i] for i in rows])
            for i, result, error in zip(rows, sampled, failed, strict=True):
                results[i], errors[i] = result, error
        if self.structured is not None:  # after the whole batch: a retried row accepts once
            for i in rows:
                result = results[i]
                if result is not None and (err := self.structured.accept(seqs[i], result.token_id)):
                    results[i], errors[i] = None, err
        return results, errors

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[SampleResult | None], list[str | None]]:
        """__call__ over the batch; if it raises (a bad value that slipped past verification,
        e.g. params changed after add_request), the generators are put back and the rows run
        one by one, so a seeded row draws what it would have drawn without the failing row."""
        states = [self.generator.get_state()]
        states += [s.generator.get_state() for s in seqs if s.generator is not None]
        try:
            return list(self(logits, seqs)), [None] * len(seqs)
        except Exception:
            pass
        gens = [self.generator] + [s.generator for s in seqs if s.generator is not None]
        for gen, state in zip(gens, states, strict=True):
            gen.set_state(state)
        results: list[SampleResult | None] = []
        errors: list[str | None] = []
        for i, seq in enumerate(seqs):
            try:
                results.append(self(logits[i : i + 1], [seq])[0])
                errors.append(None)
            except Exception as e:
                results.append(None)
                errors.append(f"{type(e).__name__}: {e}")
        return results, errors

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """logits: [S, V] float32, row i for seqs[i]."""
        logits = logits.float()
        token_ids = torch.empty(len(seqs), dtype=torch.long)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(seqs):  # no copy of the rows: [S, V] is ~10 MB at batch 48
            token_ids = self.argmax(logits)
        elif greedy:
            token_ids[greedy] = self.argmax(logits[greedy])
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = self._probs(logits[sampled], [seqs[i] for i in sampled])
            unseeded = [j for j, i in enumerate(sampled) if seqs[i].generator is None]
            if unseeded:
                picks = torch.multinomial(probs[unseeded], 1, generator=self.generator)[:, 0]
                token_ids[[sampled[j] for j in unseeded]] = picks
            for j, i in enumerate(sampled):
                gen = seqs[i].generator
                if gen is not None:  # per-request generator: same draw alone or in a batch
                    token_ids[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        ids = token_ids.tolist()
        results = [SampleResult(t, None, None) for t in ids]
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want:
            logp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                k = seqs[i].params.logprobs
                top: dict[int, float] = {}
                if k:
                    vals, idx = logp[j].topk(k)
                    top = dict(zip(idx.tolist(), vals.tolist(), strict=True))
                lp = float(logp[j, ids[i]])
                top[ids[i]] = lp
                results[i] = SampleResult(ids[i], lp, top)
        return results

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_ks = [s.params.top_k for s in seqs]
        if any(top_ks):
            vocab = logits.shape[-1]
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
        if (top_ps < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token when the tokens before it already reach top_p (keeps at least one)
            drop = (cum - sorted_logits.softmax(dim=-1)) >= top_ps[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return logits.softmax(dim=-1)
