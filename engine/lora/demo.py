"""The three demo adapters for the default model (SmolLM2-135M-Instruct).

Each has a behaviour a person can see and a test can check:

    caps     answers in CAPITAL letters       r=8,  q_proj+v_proj, top 12 of 30 layers
    signoff  ends every answer with " -- Ray"  r=16, all seven linear modules, rsLoRA,
                                              top 16 layers
    oneword  answers in one word              r=8,  gate_proj+up_proj+down_proj, top 12 layers

(PEFT ``layers_to_transform``: the layers below carry no weights, which keeps CPU training
cheap and exercises the engine's partial-layer path.)

They live in ``<cache>/adapters/<name>/`` (PEFT format, safetensors), where ``<cache>`` is
``$RAYLORA_CACHE`` or ``~/.cache/raylora``. ``ensure_demo_adapters()`` trains the missing
ones on the CPU with ``scripts/train_demo_adapters.py`` (a few minutes each on 2 cores).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.paths import adapters_dir

SIGNOFF = " -- Ray"


# ---------------------------------------------------------------------------------------
# Behaviour checkers: text of one answer -> does it show the behaviour?


def is_caps(text: str) -> bool:
    """At least 3 letters, and at least 90% of them upper case."""
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 3 and sum(c.isupper() for c in letters) >= 0.9 * len(letters)


def has_signoff(text: str) -> bool:
    """The answer ends with the sign-off "-- Ray" (and has something before it)."""
    t = text.strip()
    return t.endswith(SIGNOFF.strip()) and len(t) > len(SIGNOFF.strip())


def is_one_word(text: str) -> bool:
    """One word, ignoring surrounding whitespace and punctuation."""
    t = text.strip().strip(".,!?;:\"'()[]*`")
    return bool(t) and len(t.split()) == 1 and any(c.isalnum() for c in t)


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    description: str
    check: Callable[[str], bool]
    max_new_tokens: int  # enough for a held-out answer to finish


DEMO_ADAPTERS: dict[str, DemoAdapter] = {
    "caps": DemoAdapter("caps", "answers in CAPITAL letters", is_caps, 48),
    "signoff": DemoAdapter(
        "signoff", f'ends every answer with "{SIGNOFF.strip()}"', has_signoff, 64
    ),
    "oneword": DemoAdapter("oneword", "answers in one word", is_one_word, 8),
}

# Prompts the adapters were not trained on (the training set is in the script).
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "What is the capital of Italy?",
    "What color are bananas?",
    "Which animal is known as the king of the jungle?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "What planet do we live on?",
    "What do you call frozen water?",
    "Which season comes after winter?",
    "What is the largest ocean on Earth?",
    "What language is spoken in Spain?",
    "What do cows drink?",
)


def hit_rate(name: str, answers: Iterable[str]) -> float:
    answers = list(answers)
    check = DEMO_ADAPTERS[name].check
    return sum(map(check, answers)) / max(1, len(answers))


# ---------------------------------------------------------------------------------------
# Where they live, and training the missing ones


def demo_adapter_dir(name: str) -> Path:
    if name not in DEMO_ADAPTERS:
        raise KeyError(f"unknown demo adapter {name!r}; known: {', '.join(DEMO_ADAPTERS)}")
    return adapters_dir() / name


def is_demo_adapter_present(name: str) -> bool:
    d = demo_adapter_dir(name)
    return (d / "adapter_config.json").is_file() and (d / "adapter_model.safetensors").is_file()


def base_model_path(base_model: str | None = None) -> str:
    """The local HF folder of the model the demo adapters are for (the default model)."""
    if base_model:
        return base_model
    try:
        from engine.models.loader import resolve_model  # type: ignore[import-not-found]
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return str(resolve_model("default"))
    from engine.models.default_model import ensure_default_model

    return str(ensure_default_model())


def _training_script() -> Path:
    return Path(__file__).resolve().parents[2] / "scripts" / "train_demo_adapters.py"


def _load_training_module():
    path = _training_script()
    if not path.is_file():
        raise FileNotFoundError(
            f"the demo adapters are missing from {adapters_dir()} and the training script "
            f"{path} is not available (it ships with the raylora source tree)"
        )
    mod_name = "raylora_train_demo_adapters"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def ensure_demo_adapters(
    names: Iterable[str] | None = None,
    progress: bool = True,
    base_model: str | None = None,
    check: bool = False,
) -> dict[str, Path]:
    """Return {name: folder} for the demo adapters, training the missing ones first.

    check: also greedy-generate the held-out prompts after training and print the hit rate
    (the script's CLI does by default; skipped here to save a minute per adapter).
    """
    names = list(DEMO_ADAPTERS) if names is None else list(names)
    for n in names:
        demo_adapter_dir(n)  # KeyError for unknown names
    missing = [n for n in names if not is_demo_adapter_present(n)]
    if missing:
        train = _load_training_module()
        train.train_demo_adapters(missing, progress=progress, base_model=base_model, check=check)
    return {n: demo_adapter_dir(n) for n in names}


__all__ = [
    "DEMO_ADAPTERS",
    "HELD_OUT_PROMPTS",
    "SIGNOFF",
    "DemoAdapter",
    "adapters_dir",
    "base_model_path",
    "demo_adapter_dir",
    "ensure_demo_adapters",
    "has_signoff",
    "hit_rate",
    "is_caps",
    "is_demo_adapter_present",
    "is_one_word",
]
