"""The incremental detokenizer (engine/output_processor.py) against HF's own decode.

`ids_decoder` hands the detokenizer the Rust `tokenizers` decode of a stock fast tokenizer
(HF's Python wrapper costs more than the decode itself, twice a token); HF's `decode` stays the
reference: the same text for every window of ids, special tokens skipped or kept, and the
streamed text of a request equal to decoding all its ids at once.
"""

from __future__ import annotations

import random

import pytest

from engine.output_processor import IncrementalDetokenizer, ids_decoder
from tests.model_fixtures import make_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

TEXT = "Héllo wörld, naïve café: 東京 and 🦙🦙 emoji! <|im_end|> tabs\tand\nnew lines  done."


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def _ids(tokenizer, rng: random.Random) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids = ids + [0, 1, 2] + ids[::-1]  # special tokens and multi-byte characters split apart
    return [rng.choice(ids) if rng.random() < 0.3 else i for i in ids]


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decode_equals_hf_decode(tokenizer, skip):
    decode = ids_decoder(tokenizer)
    assert decode is not tokenizer.decode  # the stock fast tokenizer takes the Rust decode
    rng = random.Random(0)
    for _ in range(50):
        ids = _ids(tokenizer, rng)
        lo = rng.randrange(len(ids))
        hi = rng.randrange(lo, len(ids) + 1)
        window = ids[lo:hi]
        assert decode(window, skip_special_tokens=skip) == tokenizer.decode(
            window, skip_special_tokens=skip
        )


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_decoding_all_ids(tokenizer, skip):
    rng = random.Random(1)
    for _ in range(5):
        ids = _ids(tokenizer, rng)
        det = IncrementalDetokenizer(tokenizer, skip)
        deltas = [det.add(i) for i in ids]
        assert "".join(deltas) == det.text
        want = tokenizer.decode(ids, skip_special_tokens=skip)
        # only a tail of incomplete characters (random ids make several) is held back
        assert want.startswith(det.text) and set(want[len(det.text) :]) <= {"\ufffd"}


def test_tokenizers_that_clean_up_spaces_keep_hf_decode(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert ids_decoder(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False
