"""Tiny, self-contained model checkpoints for fast tests (no network, no default model).

``make_tiny_llama(path)`` writes a random LlamaForCausalLM and a real (tiny) byte-level BPE
tokenizer in the ordinary Hugging Face layout, so every code path that loads a checkpoint
folder (resolve_model, load_state_dict, tokenizer loading, chat templates) can be tested in
well under two seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

# Special tokens take ids 0, 1, 2, as in SmolLM2 (the default model).
UNK_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

# A plain ChatML template (SmolLM2's, without the default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Ray Serve routes requests to replicas; each replica batches requests.",
    "Low-rank adapters (LoRA) add a small update to a frozen base model.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "user assistant system message content <|im_start|> <|im_end|>",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
]


def make_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in memory on a few sentences (deterministic).

    Any text encodes (256 byte symbols are always in the vocabulary). Special tokens:
    ``<|endoftext|>`` (0, unk), ``<|im_start|>`` (1, bos), ``<|im_end|>`` (2, eos and pad);
    the tokenizer adds no bos by itself, and carries a ChatML chat template.
    Returns a ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def make_tiny_llama(
    path: Path,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    initializer_range: float = 0.2,
    dtype: str = "float32",
    **overrides,
) -> Path:
    """Write a tiny random Llama checkpoint (model + tokenizer) to ``path`` and return ``path``.

    The folder looks like any Hugging Face Llama checkpoint: ``config.json``,
    ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json`` (+ chat template). Weights come from ``torch.manual_seed(seed)``
    so the same arguments give the same tensors.

    - ``vocab_size``: defaults to the tokenizer's size rounded up to a multiple of 64 (the
      extra rows are never produced by the tokenizer, like padded vocabularies in real
      models); a value smaller than the tokenizer raises ValueError.
    - ``initializer_range`` defaults to 0.2 (not Llama's 0.02) so that logits are spread
      out and greedy argmax is not decided by tiny, numerically fragile gaps.
    - ``dtype``: the stored dtype ("float32", "bfloat16" or "float16").
    - ``**overrides``: any other LlamaConfig field (``rope_theta``, ``rms_norm_eps``,
      ``attention_bias``, ``head_dim``, ``architectures`` ...). Passing ``architectures``
      only rewrites config.json (to test architecture checks); the weights stay Llama's.

    Special token ids: unk 0, bos 1, eos 2 (also pad), as in the default model (SmolLM2).
    Fast: well under 2 s on one CPU core.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer()
    n_tok = len(tokenizer)
    if vocab_size is None:
        vocab_size = (n_tok + 63) // 64 * 64
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n_tok}")
    architectures = overrides.pop("architectures", None)
    rope_theta = overrides.pop("rope_theta", None)
    if rope_theta is not None:
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope_theta)}

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if architectures is not None:
        cfg_file = path / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["architectures"] = list(architectures)
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    return path
