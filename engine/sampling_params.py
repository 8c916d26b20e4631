import json as jsonlib
import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

# Below this a temperature counts as greedy (vLLM's _SAMPLING_EPS): dividing logits by a tiny
# positive temperature overflows to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as vLLM and torch take


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: the output must match exactly one of a JSON Schema
    (`json`, a dict or its JSON text), a regular expression, one string of `choice`, an EBNF
    grammar (xgrammar's GBNF dialect, with a `root` rule) or any JSON object (`json_object`).
    engine/structured/ compiles it (once per distinct value) and masks the logits with it."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: only the separators' single spaces

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    @property
    def kind(self) -> str:
        """Which constraint this is; verify() checks that exactly one is set."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def verify(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(f"structured_outputs: {msg}")

        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            bad(f"set exactly one of {', '.join(self.KINDS)} (got {kinds or 'none'})")
        if self.json is not None:
            self.schema()  # parses, or raises naming the problem
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(f"{name} must be a non-empty string, got {v!r}")
        c = self.choice
        if c is not None and (
            not isinstance(c, list | tuple) or not c or any(not isinstance(x, str) for x in c)
        ):
            bad(f"choice must be a non-empty list of strings, got {c!r}")
        if self.json_object not in (None, True, False):
            bad(f"json_object must be a boolean, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            bad(f"disable_any_whitespace must be a boolean, got {self.disable_any_whitespace!r}")

    def schema(self) -> dict[str, Any] | bool:
        """The JSON Schema, parsed (json may arrive as text)."""
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = jsonlib.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(
                    f"structured_outputs: json is not valid JSON: {e}"
                ) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(
                f"structured_outputs: json must be a JSON Schema (an object), got {schema!r:.80}"
            )
        return schema

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, disable_any_whitespace): equal keys compile to one grammar."""
        kind = self.kind
        if kind == "json":
            try:
                text = jsonlib.dumps(self.schema(), sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"structured_outputs: json is not JSON: {e}") from None
        elif kind == "choice":
            text = jsonlib.dumps(list(self.choice or []))
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace


@dataclass(slots=True)
class SamplingParams:
    """vLLM's SamplingParams (the subset raylora supports). temperature=0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    max_tokens: int | None = 16  # None: up to the context limit (max_model_len - prompt)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the sampled)
    # number of top logprobs to return per prompt token (0 = only the prompt token's own)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # constrain the output (vLLM's field); a dict is taken as StructuredOutputsParams(**dict)
    structured_outputs: StructuredOutputsParams | None = None
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self, max_n: int | None = None) -> None:
        """Raise InvalidRequestError (naming the field and the value) for anything the engine
        cannot run; also re-derives stop_strs, so a caller may change `stop` in between."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not _is_int(self.n) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if max_n is not None and self.n > max_n:
            bad(f"n must be <= {max_n} (the engine's max_n), got {self.n}")
        if not _is_finite_real(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite_real(self.top_p) or not 0 < self.top_p <= 1:
            bad(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (or -1 to disable), got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            bad(f"seed must be an integer in [-2**63, 2**63 - 1] or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        elif self.stop is None or isinstance(self.stop, list | tuple):
            self.stop_strs = list(self.stop or [])
        else:
            bad(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strs):
            bad("stop must be a non-empty string or a list of non-empty strings")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, list | tuple) or any(not _is_int(t) or t < 0 for t in ids)
        ):
            bad(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = self.structured_outputs = StructuredOutputsParams(**so)
            except TypeError as e:
                bad(f"structured_outputs: {e}")
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                bad(f"structured_outputs must be a StructuredOutputsParams, got {so!r:.80}")
            so.verify()
            if self.ignore_eos:  # the grammar ends the output with EOS; past it nothing is valid
                bad("ignore_eos cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
