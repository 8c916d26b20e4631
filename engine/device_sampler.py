"""Sampling on the model's device: DeviceSampler, Sampler's interface without the host round trip.

engine/sampler.py's Sampler works on CPU logits, row by row; on a GPU that costs a sync and an
[S, V] copy per step. DeviceSampler keeps the logits where the model left them, does the
temperature / top-k / top-p / structured-outputs work as batched tensor ops there, and brings
back only what the host needs (ids, the sampled token's logprob, the top-k logprobs, a
per-row failure flag) in one packed device-to-host copy.

Random draws use the exponential race (vLLM's `random_sample`): with q ~ Exp(1) per token,
argmax(probs / q) is distributed as probs. Unseeded rows draw q from the sampler's generator;
a seeded row draws its q row from its own device generator (seeded from params.seed and the
sequence's index, as engine/sequence.py folds them), so its tokens do not depend on its batch
and repeat across runs. These draws differ from Sampler's torch.multinomial draws for the same
seed: a seeded request is reproducible on one sampler, not across the two.

The engine must call `free(seq_id)` when a sequence finishes or is aborted (a finalizer on
the Sequence drops its generator too, should that be missed). A preempted sequence keeps its
generator, so its recompute goes on drawing where it stopped.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.sampler import Sampler, SampleResult
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.structured import StructuredOutputManager

# A row whose distribution is not finite (e.g. a NaN temperature that slipped past verify)
# fails with torch.multinomial's words, so it fails with the same reason on either sampler.
NON_FINITE = "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"

# Packed result columns (float64: token ids and float32 logprobs are exact in it), [S, 3 + 2K]:
# token id, failed (0/1), sampled token's logprob, K top ids, K top logprobs.
_ID, _BAD, _LOGP, _TOP = 0, 1, 2, 3


def seq_seed(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded with `seed` (Sequence's fold
    into manual_seed's [0, 2**64))."""
    return (seed * 1_000_003 + index) % 2**64


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    use_top_k: bool = True,
    use_top_p: bool = True,
) -> torch.Tensor:
    """The distribution each row samples from: Sampler._probs with per-row device tensors.

    Semantics (row i, V = vocabulary):
        x = logits[i] / temperature[i]
        if 0 < top_k[i] < V: x[x < kth_largest(x, top_k[i])] = -inf   # ties at the k-th kept
        if top_p[i] < 1:     # descending order, ties by token id (a stable sort)
            p = softmax(x)[order]
            drop token order[j] if sum(p[:j]) >= top_p[i]           # keeps at least one
        probs[i] = softmax(x)
    One sort serves both filters: the top-k survivors are a prefix of the sorted row, so the
    top-p pass over the masked sorted row equals Sampler's re-sort of the masked logits. A row
    with top_p = 1 never drops a token (Sampler may drop a negligible tail where the float
    cumsum reaches 1 early, in a batch that has some top_p < 1): a row's distribution never
    depends on its batch.

    Args:
        logits: [S, V] float32
        temperature: [S] float32, > 0 (greedy rows: any positive stand-in)
        top_k: [S] int64, 0 or >= V: off
        top_p: [S] float32 in (0, 1]
        use_top_k, use_top_p: host flags, whether any row filters so (else the sort is skipped)
    Returns:
        probs: [S, V] float32; a row with a non-finite temperature or logits is not finite.
    """
    x = logits / temperature[:, None]
    if not (use_top_k or use_top_p):
        return x.softmax(dim=-1)
    vocab = x.shape[-1]
    vals, order = x.sort(dim=-1, descending=True, stable=True)  # [S, V] each
    if use_top_k:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = vals.gather(1, (k - 1)[:, None])  # [S, 1]
        if not use_top_p:
            return x.masked_fill(x < kth, -math.inf).softmax(dim=-1)
        vals = vals.masked_fill(vals < kth, -math.inf)
    p = vals.softmax(dim=-1)
    threshold = torch.where(top_p < 1, top_p, math.inf)[:, None]  # [S, 1]
    vals = vals.masked_fill((p.cumsum(dim=-1) - p) >= threshold, -math.inf)
    x = torch.full_like(x, -math.inf).scatter(1, order, vals)
    return x.softmax(dim=-1)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(seq: Sequence, vocab: int) -> str | None:
    """Host-side check of the values that go into tensors: a row whose params cannot (e.g.
    changed after add_request) fails alone here, before anything runs on the device."""
    p = seq.params
    for name in ("temperature", "top_p"):
        v = getattr(p, name)
        if not _is_real(v):
            return f"TypeError: {name} must be a number, got {v!r:.80}"
    if not _is_int(p.top_k):
        return f"TypeError: top_k must be an integer, got {p.top_k!r:.80}"
    k = p.logprobs
    if k is not None and (not _is_int(k) or not 0 <= k <= vocab):
        return f"ValueError: logprobs must be an integer in [0, {vocab}], got {k!r:.80}"
    if p.seed is not None and not _is_int(p.seed):
        return f"TypeError: seed must be an integer, got {p.seed!r:.80}"
    return None


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a sync on CUDA (a pinned staging copy)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class DeviceSampler:
    """Sampler.sample_isolated on the logits' device; see the module docstring."""

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # unseeded requests
        # Set by LLMEngine (it needs the tokenizer): the grammars of constrained sequences.
        self.structured: StructuredOutputManager | None = None
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded generator

    def free(self, seq_id: int) -> None:
        """Drop a finished (or aborted) sequence's generator; unknown ids are fine."""
        self._generators.pop(seq_id, None)

    def sample_isolated(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[SampleResult | None], list[str | None]]:
        """logits: [S, V] on self.device, row i for seqs[i]. Returns (results, errors): row i
        has one of the two. As Sampler.sample_isolated: constrained rows are masked with their
        grammar's bitmask first (their logprobs are then those of the masked distribution) and
        their grammar accepts the sampled token after the batch; a row whose params are bad,
        whose distribution is not finite, or whose grammar fails, fails alone."""
        if logits.device != self.device:
            raise ValueError(f"logits on {logits.device}, sampler on {self.device}")
        logits = logits.float()
        num_rows, vocab = logits.shape
        errors: list[str | None] = [_check(s, vocab) for s in seqs]
        if self.structured is not None:
            logits = self._apply_bitmask(logits, seqs, errors)
        rows = [i for i, e in enumerate(errors) if e is None]
        results: list[SampleResult | None] = [None] * num_rows
        if rows:
            sub = logits
            if len(rows) < num_rows:
                sub = logits.index_select(0, _to_device(torch.tensor(rows), self.device))
            sampled, failed = self._sample_rows(sub, [seqs[i] for i in rows])
            for i, result, error in zip(rows, sampled, failed, strict=True):
                results[i], errors[i] = result, error
        if self.structured is not None:  # after the whole batch, as Sampler
            for i in rows:
                result = results[i]
                if result is not None and (err := self.structured.accept(seqs[i], result.token_id)):
                    results[i], errors[i] = None, err
        return results, errors

    def _apply_bitmask(
        self, logits: torch.Tensor, seqs: list[Sequence], errors: list[str | None]
    ) -> torch.Tensor:
        """Mask the constrained rows (those with params.structured_outputs) with -inf where their
        grammar disallows a token. The manager writes its bitmask into a CPU tensor of zeros
        (its apply_bitmask contract: -inf in place); that mask crosses to the device once, as
        bool. A row whose matcher fails gets its error in `errors`."""
        rows = [
            i
            for i, s in enumerate(seqs)
            if errors[i] is None and s.params.structured_outputs is not None
        ]
        if not rows or self.structured is None:
            return logits
        additive = torch.zeros(len(rows), logits.shape[1])  # [C, V] float32 on the CPU
        failed = self.structured.apply_bitmask(additive, [seqs[i] for i in rows])
        for i, err in zip(rows, failed, strict=True):
            errors[i] = err
        index = _to_device(torch.tensor(rows), self.device)
        disallowed = _to_device(additive == -math.inf, self.device)  # [C, V] bool
        masked = logits.index_select(0, index).masked_fill(disallowed, -math.inf)
        return logits.index_copy(0, index, masked)

    def _sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[SampleResult | None], list[str | None]]:
        """_sample over the batch; if it raises (a value _check could not foresee), the
        generators are put back and the rows run one by one, so a seeded row draws what it
        would have drawn without the failing row."""
        known = {s.seq_id for s in seqs if s.seq_id in self._generators}
        gens = [self.generator] + [self._generators[i] for i in known]
        states = [g.get_state() for g in gens]
        try:
            return self._sample(logits, seqs)
        except Exception:
            pass
        for gen, state in zip(gens, states, strict=True):
            gen.set_state(state)
        for s in seqs:  # made during the failed try: made afresh below
            if s.seq_id not in known:
                self._generators.pop(s.seq_id, None)
        results: list[SampleResult | None] = []
        errors: list[str | None] = []
        for i, seq in enumerate(seqs):
            try:
                (result,), (error,) = self._sample(logits[i : i + 1], [seq])
            except Exception as e:
                result, error = None, f"{type(e).__name__}: {e}"
            results.append(result)
            errors.append(error)
        return results, errors

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[SampleResult | None], list[str | None]]:
        """logits: [S, V] float32 on the device, rows already checked. One host -> device copy
        (the per-row params), one device -> host copy (the packed results)."""
        num_rows, vocab = logits.shape
        sampled = [not s.params.greedy for s in seqs]  # the host decides, as Sampler does
        ids = logits.argmax(dim=-1)  # [S]
        bad = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
        if any(sampled):
            ks = [s.params.top_k if 0 < s.params.top_k < vocab else 0 for s in seqs]
            host = torch.tensor(
                [
                    [s.params.temperature if x else 1.0, k, s.params.top_p, x]
                    for s, k, x in zip(seqs, ks, sampled, strict=True)
                ],
                dtype=torch.float32,
            )  # [S, 4]: temperature (greedy: 1), top_k (< V < 2**24: exact), top_p, sampled
            temperature, top_k, top_p, is_sampled = _to_device(host, self.device).unbind(1)
            is_sampled = is_sampled.bool()
            probs = sampling_probs(
                logits,
                temperature,
                top_k.long(),
                top_p,
                use_top_k=any(k > 0 and x for k, x in zip(ks, sampled, strict=True)),
                use_top_p=any(s.params.top_p < 1 for s, x in zip(seqs, sampled, strict=True) if x),
            )
            q = self._noise(probs, seqs, sampled)
            ids = torch.where(is_sampled, (probs / q).argmax(dim=-1), ids)
            bad = is_sampled & ~torch.isfinite(probs).all(dim=-1)
        cols = [ids.double()[:, None], bad.double()[:, None]]
        want = [s.params.logprobs for s in seqs]
        if any(k is not None for k in want):
            logp = torch.log_softmax(logits, dim=-1)  # the raw (or grammar-masked) distribution
            cols.append(logp.gather(1, ids[:, None]).double())
            num_top = max(k or 0 for k in want)
            if num_top:
                vals, top_ids = logp.topk(num_top, dim=-1)  # [S, K], descending
                cols += [top_ids.double(), vals.double()]
        packed = torch.cat(cols, dim=1).cpu().tolist()  # the one device -> host copy
        results: list[SampleResult | None] = []
        errors: list[str | None] = []
        for row, k in zip(packed, want, strict=True):
            if row[_BAD]:
                results.append(None)
                errors.append(NON_FINITE)
                continue
            token = int(row[_ID])
            if k is None:
                results.append(SampleResult(token, None, None))
            else:
                num_top = (len(row) - _TOP) // 2
                top_ids = row[_TOP : _TOP + k]
                top_vals = row[_TOP + num_top : _TOP + num_top + k]
                top = dict(zip(map(int, top_ids), top_vals, strict=True))
                top[token] = row[_LOGP]
                results.append(SampleResult(token, row[_LOGP], top))
            errors.append(None)
        return results, errors

    def _noise(
        self, probs: torch.Tensor, seqs: list[Sequence], sampled: list[bool]
    ) -> torch.Tensor:
        """q ~ Exp(1), [S, V]: from the sampler's generator, but a seeded sampled row's from its
        own generator (one [V] draw per step, whatever the batch)."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, (seq, s) in enumerate(zip(seqs, sampled, strict=True)):
            if s and seq.params.seed is not None:
                q[j] = torch.empty_like(q[j]).exponential_(generator=self._generator(seq))
        # Exp(1) may round to 0: probs / 0 would be inf for a kept token, NaN for a dropped one
        return q.clamp_min_(torch.finfo(q.dtype).tiny)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq_seed(seq.params.seed, seq.index))
            self._generators[seq.seq_id] = gen
            weakref.finalize(seq, self._generators.pop, seq.seq_id, None)
        return gen


def make_sampler(
    device: torch.device | str,
    seed: int = 0,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Sampler | DeviceSampler:
    """The sampler for logits on `device`: DeviceSampler on CUDA, Sampler (CPU logits) else,
    with `argmax` for its greedy rows (raylora_kernels.cpu_kernel.cpu_argmax_op, or torch's)."""
    if torch.device(device).type == "cuda":
        return DeviceSampler(device, seed)
    return Sampler(seed, argmax)
