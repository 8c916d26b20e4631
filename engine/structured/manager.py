"""StructuredOutputManager: grammars compiled once per distinct StructuredOutputsParams (an
LRU of compiled grammars), one xgrammar GrammarMatcher per constrained sequence, and the
token bitmask applied to a step's logits.

Threads: `compile` may run in any thread (AsyncLLMEngine runs it in a worker thread, without
the engine's lock, before the request is queued: xgrammar's compiler releases the GIL, so the
step goes on meanwhile); concurrent compiles of one key compile it once. The matchers are
touched only under the engine's lock (add_request, the step).

xgrammar is imported, and the vocabulary read into its TokenizerInfo, on first use: an engine
that never gets a constrained request never pays for it.
"""

import json
import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams
from engine.structured.json_schema import check_json_schema

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256
# Whitespace characters a JSON grammar allows between two tokens of JSON (vLLM leaves it
# unbounded; a small model can then emit newlines until max_tokens). Enough for indentation.
MAX_JSON_WHITESPACE = 32
# xgrammar 0.2.8 writes a length-bounded JSON string's characters (minLength / maxLength) as
# this class, which lets control characters through (invalid JSON: "\x1a" must be escaped);
# the grammar's text is patched to exclude them, as its unbounded strings do.
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[00:00:09] /project/cpp/x.cc:83: "

Key = tuple[str, str, bool]


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(e: BaseException) -> str:
    return _XGR_LOCATION.sub("", str(e).strip()) or type(e).__name__


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.num_compiles = 0  # grammars compiled (cache misses that succeeded)
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._compiler = None
        self._xgr: Any = None  # the xgrammar module, once imported
        self._cache: OrderedDict[Key, Any] = OrderedDict()  # key -> xgr.CompiledGrammar
        self._pending: dict[Key, Future] = {}  # key -> the compile in flight
        # Sequence -> its GrammarMatcher; a matcher lives exactly as long as its sequence (the
        # scheduler and the output processor own sequences, and drop them when they finish).
        self._matchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- compiling ------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for params (cached); InvalidRequestError naming the problem if
        it cannot compile. Thread-safe."""
        params.verify()
        key = params.key()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            future = self._pending.get(key)
            owner = future is None
            if owner:
                future = self._pending[key] = Future()
        if not owner:
            return future.result()  # another thread compiles it: its grammar or its error
        try:
            grammar = self._compile(params)
        except BaseException as e:
            with self._lock:
                del self._pending[key]
            future.set_exception(e)
            raise
        with self._lock:
            del self._pending[key]
            self._cache[key] = grammar
            self.num_compiles += 1
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        future.set_result(grammar)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        schema = params.schema() if kind == "json" else None
        if schema is not None:
            check_json_schema(schema)
        compiler = self._get_compiler()
        whitespace = {"any_whitespace": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            whitespace["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
        try:
            if kind in ("json", "json_object"):
                strict = kind == "json"  # json_object: any JSON object (OpenAI's mode)
                text = json.dumps(schema if strict else {"type": "object"})
                grammar = self._xgr.Grammar.from_json_schema(text, strict_mode=strict, **whitespace)
                ebnf = str(grammar).replace(_LENIENT_STRING_CHAR, _JSON_STRING_CHAR)
                return compiler.compile_grammar(ebnf)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(list(params.choice or [])))
            return compiler.compile_grammar(params.grammar)
        except Exception as e:  # xgrammar raises RuntimeError with the parser's message
            raise InvalidRequestError(
                f"structured_outputs: invalid {kind}: {_message(e)}"
            ) from None

    def _get_compiler(self) -> Any:
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._xgr = xgr
                info = _tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_token_ids)
                # one compile thread per two cores: the step keeps the others
                threads = max(1, (os.cpu_count() or 2) // 2)
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
            return self._compiler

    # -- matching -------------------------------------------------------------------------
    def add_sequences(self, seqs: list, grammar: Any) -> None:
        """One matcher per sequence (of a request's n), at the grammar's start."""
        import xgrammar as xgr

        for seq in seqs:
            self._matchers[seq] = xgr.GrammarMatcher(grammar)

    def apply_bitmask(self, logits: torch.Tensor, seqs: list) -> list[str | None]:
        """Set to -inf, in place, the logits (row i for seqs[i], [S, V] float32 on the CPU) of
        the tokens each constrained sequence's grammar does not allow next; unconstrained rows
        are left alone. Returns an error per row (None: fine): a row whose matcher fails
        fails alone, unmasked, and must not be sampled."""
        errors: list[str | None] = [None] * len(seqs)
        rows = [(i, m) for i, s in enumerate(seqs) if (m := self._matchers.get(s)) is not None]
        if not rows:
            return errors
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # [S, ceil(V / 32)]
        filled = []
        for i, matcher in rows:
            try:
                if matcher.is_terminated():
                    raise RuntimeError("the grammar has already ended")
                matcher.fill_next_token_bitmask(bitmask, i)
                filled.append(i)
            except Exception as e:
                errors[i] = f"GrammarError: {_message(e)}"
        if filled:
            try:
                xgr.apply_token_bitmask_inplace(
                    logits, bitmask, vocab_size=self.vocab_size, indices=filled
                )
            except Exception as e:  # nothing masked: none of the constrained rows may sample
                for i in filled:
                    errors[i] = f"GrammarError: {_message(e)}"
        return errors

    def accept(self, seq: Any, token_id: int) -> str | None:
        """Advance seq's grammar by its sampled token; an error if the grammar refuses it."""
        matcher = self._matchers.get(seq)
        try:
            if matcher is None or matcher.accept_token(token_id):
                return None
        except Exception as e:
            return f"GrammarError: {_message(e)}"
        text = self.tokenizer.decode([token_id])
        return f"GrammarError: the grammar does not allow token {token_id} ({text!r}) here"


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens made special
    (empty): otherwise "<|im_start|>" could be emitted as JSON string text, which the
    detokenizer (skip_special_tokens) would then drop from the output."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    vocab = [""] * vocab_size
    for token, idx in tokenizer.get_vocab().items():
        if idx < vocab_size:
            vocab[idx] = token
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    for idx in special:
        if 0 <= idx < vocab_size:
            vocab[idx] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())
