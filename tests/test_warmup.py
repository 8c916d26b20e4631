"""The start-up warm-up (engine/warmup.py) runs real requests and leaves no trace: an engine
that warmed up reports the stats, residency and free blocks of one that did not, and then
generates the same tokens (greedy, engine-seeded sampling, adapters) as that one."""

import pytest

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.lora.manager import LoRAManager
from engine.warmup import WARMUP_LORA
from tests.lora_fixtures import make_adapter_set

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    paths = make_adapter_set(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    return {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(paths.items())}


def make_engine(model: str, warm_up: bool, **kw) -> LLMEngine:
    cfg = dict(model=model, max_loras=2, max_num_seqs=8, num_kv_blocks=64, seed=7)
    return LLMEngine(EngineConfig(**{**cfg, **kw}, warm_up=warm_up))


def generate(engine: LLMEngine, loras: dict[str, LoRARequest]) -> dict[str, list[int]]:
    prompts = ["Hello world!", "The capital of France is", "One, two, three,"]
    kinds = [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=1.0),  # the engine's generator, no seed
    ]
    names = [None, *loras]
    for i, prompt in enumerate(prompts * 2):
        lora = loras[names[i % len(names)]] if names[i % len(names)] else None
        engine.add_request(f"r{i}", prompt, kinds[i % 2], lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_warm_up_leaves_no_trace(tiny_model_dir, adapters, monkeypatch):
    activated: list[str] = []
    activate = LoRAManager.activate

    def recording(self, slot, lora):
        activated.append(lora.lora_name)
        return activate(self, slot, lora)

    monkeypatch.setattr(LoRAManager, "activate", recording)
    warm = make_engine(tiny_model_dir, True)
    assert WARMUP_LORA in activated  # the LoRA path ran
    assert warm.scheduler.step_count > 0 and warm.warm_up_seconds > 0
    cold = make_engine(tiny_model_dir, False)
    assert cold.scheduler.step_count == 0 and cold.warm_up_seconds == 0
    assert warm.stats() == cold.stats()
    assert warm.list_loras() == [] and warm.residency() == ([], [])
    assert warm.block_manager.num_cached_blocks == 0
    assert generate(warm, adapters) == generate(cold, adapters)
    assert untimed(warm.stats()) == untimed(cold.stats())


def untimed(stats: dict) -> dict:
    """stats() without the measured read times (their presence kept: None or a number)."""
    lora = {k: (v if not k.endswith("_ms") else v is None) for k, v in stats["lora"].items()}
    return {**stats, "lora": lora}


def test_warm_up_without_lora_or_prefix_caching(tiny_model_dir):
    kw = dict(enable_lora=False, enable_prefix_caching=False)
    warm, cold = make_engine(tiny_model_dir, True, **kw), make_engine(tiny_model_dir, False, **kw)
    assert warm.stats() == cold.stats()
    assert generate(warm, {}) == generate(cold, {})


def test_warm_up_is_a_bool_or_none():
    with pytest.raises(ValueError, match="warm_up"):
        EngineConfig(warm_up="yes")


def test_attention_variants_cover_every_eager_launch():
    """Every (table width, rows) an eager step can launch compiles the same kernel variant
    as one of the warm-up's launches: its split count and the width's specialisation."""
    from engine.warmup import attention_variants
    from raylora_kernels.paged_attention import choose_num_splits

    def key(width: int, rows: int) -> tuple:
        return (choose_num_splits(width, rows, 3, 132), width == 1, width % 16 == 0)

    variants = attention_variants(256, 64, 3, 132)
    covered = {key(w, r) for w, r in variants}
    assert len(covered) == len(variants)  # one launch per variant
    assert {key(w, r) for w in range(1, 257) for r in range(1, 65)} == covered
    assert {s for s, _, _ in covered} == {1, 2, 4, 8, 16}


def test_warm_up_fits_a_short_model(tiny_model_dir):
    """Prompts and outputs are cut to max_model_len: engines of 8 and of 2 positions warm up."""
    for max_len in (8, 2):
        engine = make_engine(tiny_model_dir, True, max_model_len=max_len, enable_lora=False)
        assert engine.warm_up_seconds > 0 and engine.stats()["num_running"] == 0
