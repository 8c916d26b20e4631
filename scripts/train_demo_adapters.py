#!/usr/bin/env python
"""Train the three demo LoRA adapters for the default model on the CPU.

    python scripts/train_demo_adapters.py              # train the missing ones
    python scripts/train_demo_adapters.py --force      # retrain all
    python scripts/train_demo_adapters.py caps --base-model /path/to/hf/folder

Adapters (see engine/lora/demo.py):
    caps     answers in CAPITAL letters          r=8,  q_proj+v_proj, top 12 layers
    signoff  ends every answer with " -- Ray"     r=16, all linear modules, rsLoRA, top 16 layers
    oneword  answers in one word                 r=8,  gate_proj+up_proj+down_proj, top 12 layers

The training data is synthetic: hand-written short answers to a few dozen questions,
transformed per behaviour, in the model's chat template; the loss is on the answer only.
After training, each adapter answers held-out questions with greedy decoding and the
script prints the hit rate of its behaviour. Output: <cache>/adapters/<name>/ (PEFT
save_pretrained, safetensors), written into a temp folder and moved in with os.replace.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from scripts.demo_adapter_data import ADAPTER_SETTINGS, BATCH_SIZE, QA, SEED  # noqa: E402


def _demo_module():
    """engine.lora.demo; loaded by file path if the engine package itself fails to import."""
    try:
        import engine.lora.demo as demo

        return demo
    except ImportError:
        import importlib.util

        name = "engine.lora.demo"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, _ROOT / "engine" / "lora" / "demo.py")
        demo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(demo)
        return demo


_demo = _demo_module()
DEMO_ADAPTERS = _demo.DEMO_ADAPTERS
HELD_OUT_PROMPTS = _demo.HELD_OUT_PROMPTS
SIGNOFF = _demo.SIGNOFF
adapters_dir = _demo.adapters_dir
demo_adapter_dir = _demo.demo_adapter_dir
hit_rate = _demo.hit_rate
is_demo_adapter_present = _demo.is_demo_adapter_present


def target_text(name: str, answer: str, one_word: str) -> str:
    if name == "caps":
        return answer.upper()
    if name == "signoff":
        return answer + SIGNOFF
    if name == "oneword":
        return one_word
    raise KeyError(name)


# ---------------------------------------------------------------------------------------
# The base model


def load_base(base_model: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _demo.base_model_path(base_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # bfloat16 for the frozen base: several times faster on CPUs with AVX512-BF16 / AMX;
    # the LoRA weights themselves stay float32 (PEFT's autocast_adapter_dtype).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    return model, tokenizer


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


# ---------------------------------------------------------------------------------------
# Training


def _examples(tokenizer, name: str) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per QA pair; labels are -100 on the prompt (loss on the answer)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for q, a, w in QA:
        p = tokenizer(chat_prompt(tokenizer, q), add_special_tokens=False).input_ids
        t = tokenizer(target_text(name, a, w), add_special_tokens=False).input_ids + [eos]
        out.append((p + t, [-100] * len(p) + t))
    return out


def _pad(rows, value, dtype):
    import torch

    n = max(len(r) for r in rows)
    out = torch.full((len(rows), n), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


@contextlib.contextmanager
def _only_layers(llama_model, start: int, stop: int | None = None) -> Iterator[None]:
    """Run only decoder layers [start:stop] (their input comes in as inputs_embeds)."""
    import torch

    layers = llama_model.layers
    llama_model.layers = torch.nn.ModuleList(list(layers)[start:stop])
    try:
        yield
    finally:
        llama_model.layers = layers


def _layer_inputs(llama_model, examples, start: int, batch: int = 16):
    """The (frozen) input of decoder layer `start` for every example: base model, no LoRA."""
    import torch

    if start == 0:
        return [llama_model.embed_tokens(torch.tensor(ids)).detach() for ids, _ in examples]
    captured = {}
    hook = llama_model.layers[start - 1].register_forward_hook(
        lambda _m, _i, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out)
    )
    out = []
    try:
        with torch.no_grad(), _only_layers(llama_model, 0, start):
            for i in range(0, len(examples), batch):
                chunk = examples[i : i + batch]
                ids = _pad([x for x, _ in chunk], 0, torch.long)
                mask = _pad([[1] * len(x) for x, _ in chunk], 0, torch.long)
                llama_model(input_ids=ids, attention_mask=mask, use_cache=False)
                out += [captured["h"][j, : len(x)].clone() for j, (x, _) in enumerate(chunk)]
    finally:
        hook.remove()
    return out


def generate_answers(model, tokenizer, questions: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy answers (batched, left padded)."""
    import torch

    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(
            [chat_prompt(tokenizer, q) for q in questions],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=2 if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
            )
    finally:
        tokenizer.padding_side = old_side
    return [tokenizer.decode(o[enc.input_ids.shape[1] :], skip_special_tokens=True) for o in out]


def train_one(
    name: str, model, tokenizer, progress: bool = True, seed: int = SEED, steps: int | None = None
):
    """Wrap `model` with a fresh LoRA, train it, and return the PeftModel.

    Cheap on a CPU: the loss is on the answer tokens only (lm_head runs on those alone),
    and with layers_to_transform the frozen layers below the first adapted one run once,
    up front, instead of at every step.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    s = ADAPTER_SETTINGS[name]
    steps = s["steps"] if steps is None else steps
    # LoRA on the top `top_layers` decoder layers only (PEFT layers_to_transform).
    n_layers = model.config.num_hidden_layers
    start = max(0, n_layers - s["top_layers"]) if s.get("top_layers") else 0
    layers = list(range(start, n_layers)) if start > 0 else None
    examples = _examples(tokenizer, name)
    llama = model.model
    hidden = _layer_inputs(llama, examples, start)

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=s["r"],
        lora_alpha=s["lora_alpha"],
        target_modules=s["target_modules"],
        layers_to_transform=layers,
        use_rslora=s["use_rslora"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s["lr"], weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * max(0.1, 1 - i / steps)
    )
    rng = random.Random(seed)
    order: list[int] = []
    peft_model.train()
    bar = tqdm(range(steps), desc=f"training {name}", disable=not progress, file=sys.stderr)
    with _only_layers(llama, start):
        for _ in bar:
            if len(order) < BATCH_SIZE:
                more = list(range(len(examples)))
                rng.shuffle(more)
                order += more
            idx, order = order[:BATCH_SIZE], order[BATCH_SIZE:]
            n = max(len(examples[i][0]) for i in idx)
            h = torch.zeros(len(idx), n, hidden[0].shape[-1], dtype=hidden[0].dtype)
            for j, i in enumerate(idx):
                h[j, : len(hidden[i])] = hidden[i]
            mask = _pad([[1] * len(examples[i][0]) for i in idx], 0, torch.long)
            labels = _pad([examples[i][1] for i in idx], -100, torch.long)
            out = llama(inputs_embeds=h, attention_mask=mask, use_cache=False).last_hidden_state
            # position t predicts token t+1: logits only where there is a label to predict.
            targets = labels[:, 1:]
            keep = targets != -100
            logits = model.lm_head(out[:, :-1][keep]).float()
            loss = torch.nn.functional.cross_entropy(logits, targets[keep])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    peft_model.eval()
    return peft_model


def evaluate(name: str, peft_model, tokenizer) -> tuple[float, list[str]]:
    answers = generate_answers(
        peft_model, tokenizer, HELD_OUT_PROMPTS, DEMO_ADAPTERS[name].max_new_tokens
    )
    return hit_rate(name, answers), answers


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _save_atomic(name: str, peft_model, info: dict) -> Path:
    final = demo_adapter_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        peft_model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "raylora_demo.json").write_text(json.dumps(info, indent=2) + "\n")
        if final.exists():
            old = final.parent / f".{name}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def train_demo_adapters(
    names: Sequence[str] | None = None,
    force: bool = False,
    progress: bool = True,
    base_model: str | None = None,
    check: bool = True,
) -> dict[str, Path]:
    """Train (the missing, or with force all of) `names`; return {name: folder}."""
    names = list(DEMO_ADAPTERS) if names is None else list(names)
    for n in names:
        demo_adapter_dir(n)
    todo = [n for n in names if force or not is_demo_adapter_present(n)]
    if todo:
        with _lock(adapters_dir() / ".train.lock"):
            todo = [n for n in todo if force or not is_demo_adapter_present(n)]
            if todo:
                _train(todo, progress, base_model, check)
    return {n: demo_adapter_dir(n) for n in names}


def _train(todo: list[str], progress: bool, base_model: str | None, check: bool) -> None:
    t0 = time.perf_counter()
    model, tokenizer = load_base(base_model)
    _log(progress, f"loaded the base model in {time.perf_counter() - t0:.1f}s")
    for name in todo:
        t1 = time.perf_counter()
        peft_model = train_one(name, model, tokenizer, progress=progress)
        train_s = time.perf_counter() - t1
        info = {
            "name": name,
            "description": DEMO_ADAPTERS[name].description,
            "seed": SEED,
            "train_seconds": round(train_s, 1),
            **{k: v for k, v in ADAPTER_SETTINGS[name].items()},
        }
        if check:
            rate, answers = evaluate(name, peft_model, tokenizer)
            info["held_out_hit_rate"] = rate
            _log(
                progress,
                f"{name}: held-out hit rate {rate:.0%} "
                f"({DEMO_ADAPTERS[name].description}); trained in {train_s:.0f}s",
            )
            for q, a in zip(HELD_OUT_PROMPTS, answers, strict=True):
                _log(progress, f"    {q!r} -> {a!r}")
        path = _save_atomic(name, peft_model, info)
        _log(progress, f"saved {path}")
        model = peft_model.unload()  # back to the plain base model for the next adapter


def _log(on: bool, msg: str) -> None:
    if on:
        print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument(
        "names", nargs="*", help=f"adapters to train (default: all of {list(DEMO_ADAPTERS)})"
    )
    ap.add_argument("--force", action="store_true", help="retrain even if present")
    ap.add_argument("--base-model", default=None, help="HF folder of the base model")
    ap.add_argument("--no-check", action="store_true", help="skip the held-out check")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in DEMO_ADAPTERS]
    if unknown:
        ap.error(f"unknown adapter(s) {unknown}; choose from {list(DEMO_ADAPTERS)}")
    out = train_demo_adapters(
        args.names or None, force=args.force, base_model=args.base_model, check=not args.no_check
    )
    for n, p in out.items():
        print(f"{n}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
