"""The default model's GGUF as a plain Hugging Face checkpoint: load (and dequantise) it with
transformers, then save its weights, config and tokenizer the way a Hub checkpoint of
SmolLM2-135M-Instruct is laid out. engine/models/default_model.py calls these from its
conversion (staging folder, lock, provenance)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.default_model import DefaultModelError

# SmolLM2-Instruct's ChatML template, as published with HuggingFaceTB/SmolLM2-135M-Instruct.
# The GGUF carries the same template; this is the fallback if a GGUF ever lacks one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|endoftext|>"


def load_gguf(gguf_path: Path):
    """Load (and dequantise) the GGUF with transformers. Returns (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model, tokenizer


def _clean_config_dict(model) -> dict:
    cfg = model.config.to_dict()
    for key in (
        "quantization_config",
        "_model_name_or_path",
        "_name_or_path",
        "transformers_version",
    ):
        cfg.pop(key, None)
    sd_tied = _is_tied(model)
    cfg["tie_word_embeddings"] = sd_tied
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    # GGUF stores the epsilon as float32 (9.999999747e-06); this is the same float32 value.
    eps = cfg.get("rms_norm_eps")
    if isinstance(eps, float) and abs(eps - 1e-5) < 1e-12:
        cfg["rms_norm_eps"] = 1e-5
    cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"] = 1, 2, 2
    return cfg


def _is_tied(model) -> bool:
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return emb.data_ptr() == head.data_ptr() or bool(torch.equal(emb, head))


def save_checkpoint(model, tokenizer, out: Path) -> None:
    """Save the GGUF-loaded model and tokenizer as a plain HF checkpoint in ``out``.

    A GGUF-loaded model carries a gguf quantization config and cannot be saved directly,
    so its weights are moved into a fresh LlamaForCausalLM built from a cleaned config.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_clean_config_dict(model))
    state = model.state_dict()
    with torch.device("meta"):
        fresh = LlamaForCausalLM(cfg)
    missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise DefaultModelError(
            f"GGUF weights do not match LlamaForCausalLM: missing={missing[:5]} "
            f"unexpected={unexpected[:5]}"
        )
    if cfg.tie_word_embeddings:
        fresh.tie_weights()
    fresh.eval()
    fresh.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    fresh.save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    del fresh


def _save_tokenizer(tokenizer, out: Path) -> None:
    """Save the tokenizer as a PreTrainedTokenizerFast with SmolLM2's special tokens and template."""
    from transformers import PreTrainedTokenizerFast

    template = getattr(tokenizer, "chat_template", None) or SMOLLM2_CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=template,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    for tok, want in ((BOS_TOKEN, 1), (EOS_TOKEN, 2), (UNK_TOKEN, 0)):
        got = fast.convert_tokens_to_ids(tok)
        if got != want:
            raise DefaultModelError(f"GGUF tokenizer maps {tok} to {got}, expected {want}")
    fast.save_pretrained(out)
    # Older transformers (4.x) know neither "TokenizersBackend" nor chat_template.jinja: name
    # the portable class and keep a copy of the template in tokenizer_config.json as well.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = template
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
