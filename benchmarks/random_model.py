"""A random-weight copy of a Llama checkpoint: same config and tokenizer, seeded weights.

    python benchmarks/random_model.py --like ~/.cache/raylora/models/SmolLM2-135M-Instruct \
        --out /tmp/smollm2-random

For timing on a machine that has not got the weights (the GPU check carries only the config
and tokenizer files): step times depend on the shapes, not on the values. Every file of --like
except weights is copied; the weights are LlamaForCausalLM's own init from --seed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# The repository root first on the path, not benchmarks/: the project's packages must be found
# before any script of benchmarks/ of the same name.
sys.path[0] = str(Path(__file__).resolve().parents[1])

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def make_random_model(like: Path, out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    config = LlamaConfig.from_pretrained(str(like))
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--like", required=True, type=Path, help="checkpoint folder (config.json)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(
        f"random weights for {args.like.name} -> {make_random_model(args.like, args.out, args.seed)}"
    )


if __name__ == "__main__":
    main()
