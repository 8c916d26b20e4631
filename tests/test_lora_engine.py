"""Multi-LoRA in the engine against PEFT: three adapter shapes plus base requests in one engine
with max_loras=2, so adapters are deferred and swapped; greedy tokens equal PEFT's."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from engine.lora import errors
from engine.model_runner import ModelRunnerOutput
from engine.models.llama import PACKED_MODULES
from tests.lora_fixtures import ADAPTER_SPECS, cpu_kernel_mode, make_adapter_set
from tests.reference import assert_greedy_match, hf_greedy

PROMPTS = [
    "Hello world!",
    "The capital of France is",
    "def add(a, b):\n    return",
    "One, two, three, four, five,",
    "Low-rank adapters (LoRA) add a small update",
]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    paths = make_adapter_set(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    return {k: str(v) for k, v in paths.items()}


def lora_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    return {n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())}


def workload(loras: dict[str, LoRARequest]) -> list[tuple[str, str, LoRARequest | None]]:
    """(req_id, prompt, lora) interleaving every adapter and the base model."""
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        for name in [*loras, None]:
            reqs.append((f"{name}-{i}", prompt, loras[name] if name else None))
    return reqs


def run_checked(engine: LLMEngine, reqs, params, max_loras: int) -> dict[str, list[int]]:
    """Run to completion, checking the max_loras bound on every step."""
    for rid, prompt, lora in reqs:
        engine.add_request(rid, prompt, params, lora)
    done, max_seen = {}, 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        adapters_in_batch = {s.seq.lora_name for s in out.scheduled} - {None}
        assert len(adapters_in_batch) <= max_loras
        max_seen = max(max_seen, len(adapters_in_batch))
        sampled = engine.model_runner.execute(out) if not out.is_empty else ModelRunnerOutput()
        engine.scheduler.update_from_output(out)
        for o in engine.output_processor.process(out, sampled, engine.scheduler):
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert max_seen == max_loras
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return done


def peft_references(model_dir, adapters, reqs, tokenizer, max_tokens, eos, lora_round=None):
    """PEFT's fp32 greedy output per request. lora_round: round every LoRA weight to this
    dtype first (the values an engine with that lora_dtype holds; the math stays fp32)."""
    refs = {}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    models = {None: base}
    for name, path in adapters.items():
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(m, path).eval()
        if lora_round is not None:
            with torch.no_grad():
                for pname, w in models[name].named_parameters():
                    if "lora_" in pname:
                        w.copy_(w.to(lora_round).float())
    for rid, prompt, lora in reqs:
        model = models[lora.lora_name if lora else None]
        ids = tokenizer(prompt).input_ids
        refs[rid] = (model, ids, hf_greedy(model, ids, max_tokens, eos))
    return refs


def check_parity(model_dir, adapters, engine, max_tokens=10, lora_round=None):
    loras = lora_requests(adapters)
    reqs = workload(loras)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ours = run_checked(engine, reqs, params, engine.config.max_loras)
    refs = peft_references(
        model_dir,
        adapters,
        reqs,
        engine.tokenizer,
        max_tokens,
        engine.output_processor.eos_token_ids,
        lora_round,
    )
    exact = sum(assert_greedy_match(m, ids, ours[rid], ref) for rid, (m, ids, ref) in refs.items())
    assert exact >= len(reqs) - 1
    # the adapters really change the output (else the test could not fail)
    assert ours["qv4-1"] != ours["None-1"] or ours["all16-1"] != ours["None-1"]
    stats = engine.stats()
    assert stats["lora"]["evictions"] > 0  # three adapters, two slots: swapped
    return ours


def parity_engine(model_dir: str, **overrides) -> LLMEngine:
    """The engine of the three-adapter parity workload: two slots and a CPU cache of two for
    three adapters (deferrals, slot swaps and CPU evictions), small KV blocks. overrides:
    any other EngineConfig field (lora_dtype, device, dtype, lora_backend...)."""
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            max_loras=2,
            max_lora_rank=16,
            max_cpu_loras=2,
            max_num_seqs=8,
            block_size=4,
            **overrides,
        )
    )


@pytest.mark.parametrize("cpu_kernel", ["on", "off"])
def test_three_adapters_two_slots_match_peft(tiny_model_dir, adapters, monkeypatch, cpu_kernel):
    """Decode batches go to the C++ CPU kernel when it is on, to torch ops when it is off
    (RAYLORA_CPU_KERNEL=0); prefill always to torch ops. Both must match PEFT."""
    from raylora_kernels.backends import CPULoRABackend

    op_calls = cpu_kernel_mode(monkeypatch, "cpu_kernel" if cpu_kernel == "on" else "torch_ops")
    metas = []
    real = CPULoRABackend.prepare

    def spy(backend, meta):  # once per forward: the step's batch
        if meta is not None and not meta.no_lora:
            metas.append(meta)
        return real(backend, meta)

    monkeypatch.setattr(CPULoRABackend, "prepare", spy)
    engine = parity_engine(tiny_model_dir)
    check_parity(tiny_model_dir, adapters, engine)
    assert engine.model_runner.lora_manager.num_cpu_evictions > 0  # CPU cache of 2 for 3
    # The runner hands the kernels each batch grouped by slot (order_by_slot), which is what
    # lets the torch path use views; the workload interleaves adapters and base requests.
    assert metas and all(m.tokens_sorted for m in metas)
    assert any(m.num_active_slots == 2 and m.num_lora_tokens < m.num_tokens for m in metas)
    assert bool(op_calls) == (cpu_kernel == "on")
    # each slot's ranks (what the C++ kernel reads of it): the adapter's r on the slices it
    # targets, 0 on the others
    manager = engine.model_runner.lora_manager
    assert any(manager.slot_names)
    for (_, packed), lin in manager.linears.items():
        for slot, name in enumerate(manager.slot_names):
            if name is not None:
                spec = ADAPTER_SPECS[name]
                want = [
                    spec["r"] if m in spec["target_modules"] else 0 for m in PACKED_MODULES[packed]
                ]
                assert lin.lora.ranks[slot].tolist() == want, (packed, name)


@pytest.mark.parametrize(
    "lora_dtype,cpu_kernel", [("bfloat16", "on"), ("bfloat16", "off"), ("float16", "on")]
)
def test_narrow_lora_weights_under_fp32_model_match_peft(
    tiny_model_dir, adapters, monkeypatch, lora_dtype, cpu_kernel
):
    """lora_dtype="bfloat16": the slots hold bf16 weights (half the bytes a decode step reads),
    the math stays fp32 (the C++ kernel, or torch ops on widened weights). float16 is not a
    kernel dtype: torch ops, widened. The reference is PEFT in fp32 on the same rounded values
    (the scalings 2, 2 and 8 are powers of two, so folding them into B rounds alike)."""
    op_calls = cpu_kernel_mode(monkeypatch, "cpu_kernel" if cpu_kernel == "on" else "torch_ops")
    dtype = getattr(torch, lora_dtype)
    engine = parity_engine(tiny_model_dir, lora_dtype=lora_dtype)
    assert engine.model_runner.dtype == torch.float32
    assert all(
        lin.lora.a.dtype == dtype for lin in engine.model_runner.model.lora_linears().values()
    )
    ours = check_parity(tiny_model_dir, adapters, engine, lora_round=dtype)
    assert bool(op_calls) == (cpu_kernel == "on" and lora_dtype == "bfloat16")
    # the rounding is real: fp32 slots give other tokens somewhere in this workload
    reqs = workload(lora_requests(adapters))
    exact = run_checked(
        parity_engine(tiny_model_dir), reqs, SamplingParams(temperature=0, max_tokens=10), 2
    )
    assert exact != ours


def test_lora_dtype_is_checked():
    with pytest.raises(ValueError, match="lora_dtype must be"):
        EngineConfig(lora_dtype="int8")


def test_triton_needs_lora_dtype_equal_to_the_model_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match="triton LoRA backend needs them equal"):
        LLMEngine(EngineConfig(model=tiny_model_dir, lora_backend="triton", lora_dtype="bfloat16"))


@pytest.mark.timeout(600)
def test_triton_kernels_in_engine_under_interpreter(tiny_model_dir, adapters, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = LLMEngine(
        EngineConfig(
            model=tiny_model_dir,
            max_loras=2,
            max_lora_rank=16,
            max_num_seqs=16,
            block_size=4,
            lora_backend="triton",
        )
    )
    assert engine.model_runner.lora_backend.name == "triton"
    check_parity(tiny_model_dir, adapters, engine, max_tokens=4)
    # the kernels read each slot's rows up to its adapter's rank (ranks_device, kept in sync)
    linears = engine.model_runner.model.lora_linears().values()
    assert all(torch.equal(lin.lora.ranks_device.long(), lin.lora.ranks) for lin in linears)
    assert any(0 < r < 16 for lin in linears for r in lin.lora.ranks.flatten().tolist())


BAD_CASES = {
    "missing": (lambda root: str(root / "nope"), errors.LoRANotFoundError),
    "no_config": (lambda root: _bad(root, "no_config", config=None), errors.AdapterConfigError),
    "rank_too_big": (lambda root: _bad(root, "big", r=64), errors.LoRARankError),
    "dora": (lambda root: _bad(root, "dora", use_dora=True), errors.UnsupportedLoRAFeatureError),
    "corrupt": (lambda root: _bad(root, "corrupt", corrupt=True), errors.CorruptLoRAWeightsError),
}


def _bad(root, name, config="keep", corrupt=False, **changes):
    import json
    import shutil

    src = root / "qv4"
    dst = root / f"bad-{name}"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    cfg_path = dst / "adapter_config.json"
    if config is None:
        cfg_path.unlink()
    elif changes:
        cfg = json.loads(cfg_path.read_text())
        cfg.update(changes)
        cfg_path.write_text(json.dumps(cfg))
    if corrupt:
        w = dst / "adapter_model.safetensors"
        w.write_bytes(w.read_bytes()[:100])
    return str(dst)


def test_bad_adapters_do_not_disturb_the_batch(tiny_model_dir, adapters):
    from pathlib import Path

    root = Path(adapters["qv4"]).parent
    loras = lora_requests(adapters)
    params = SamplingParams(temperature=0, max_tokens=8)
    reqs = workload(loras)[:8]

    def make():
        return LLMEngine(
            EngineConfig(
                model=tiny_model_dir, max_loras=2, max_lora_rank=16, max_num_seqs=8, block_size=4
            )
        )

    clean = run_checked(make(), reqs, params, 2)
    engine = make()
    for rid, prompt, lora in reqs:
        engine.add_request(rid, prompt, params, lora)
    done = {}
    for i, (case, (build, exc)) in enumerate(BAD_CASES.items()):
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        bad = LoRARequest(f"bad-{case}", 100 + i, build(root))
        with pytest.raises(exc):
            engine.add_request(f"bad-{case}", "Hello", params, bad)
        assert f"bad-{case}" not in engine.list_loras()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done == clean


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_default_model_three_adapters_match_peft(default_model_dir, tmp_path):
    adapters = {
        k: str(v) for k, v in make_adapter_set(default_model_dir, tmp_path, std=0.02).items()
    }
    engine = LLMEngine(
        EngineConfig(
            model="default",
            max_loras=2,
            max_lora_rank=16,
            max_num_seqs=8,
            max_num_batched_tokens=256,
        )
    )
    check_parity(default_model_dir, adapters, engine, max_tokens=8)
