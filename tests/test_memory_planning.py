"""GPU memory planning (engine/memory.py), the model built in its dtype, streamed shards.

The planner is pure arithmetic driven by a fake mem_get_info; the profiling forward and the
loaders run on the CPU through the real model, with an allocation probe (a TorchDispatchMode
that counts the bytes of every storage an aten op allocates while that storage lives).
"""

from __future__ import annotations

import gc
import json
import math
import shutil
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine import EngineConfig
from engine.lora.adapter import LoRAModelSpec
from engine.lora.manager import LoRAManager
from engine.memory import (
    KVCacheMemoryError,
    MemorySnapshot,
    dummy_seq_lens,
    plan_kv_blocks,
    profile_run,
)
from engine.models.llama import LlamaForCausalLM, ModelArgs, rope_inv_freq
from engine.models.loader import (
    LazyStateDict,
    build_model,
    iter_weights,
    load_model,
    load_model_config,
    load_state_dict,
)
from raylora_kernels import make_lora_backend
from tests.model_fixtures import make_tiny_llama

GiB, MiB = 2**30, 2**20


class AllocationProbe(TorchDispatchMode):
    """Live and peak bytes of the storages that aten ops allocate on a real device (ops whose
    schema returns no alias), each counted until its storage dies; `allocations` lists them."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.allocations: list[tuple[str, torch.dtype, int]] = []  # (op, dtype, numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.allocations.append((str(func), t.dtype, t.numel()))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


class ProbeMeter:
    """engine.memory.MemoryMeter over an AllocationProbe (what CudaMeter is on CUDA)."""

    def __init__(self, probe: AllocationProbe) -> None:
        self.probe = probe

    def reset_peak(self) -> None:
        self.probe.peak = self.probe.live

    def allocated(self) -> int:
        return self.probe.live

    def peak(self) -> int:
        return self.probe.peak


class RecordingBackend:
    """A LoRA backend that records how many slots each step it is prepared for uses (not the
    batch itself: that would keep its tensors alive)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.meta = inner, inner.name, None
        self.active_slots: list[int] = []

    def prepare(self, meta):
        self.active_slots.append(0 if meta is None or meta.no_lora else meta.num_active_slots)
        return self.inner.prepare(meta)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("mem") / "tiny")


@pytest.fixture(scope="module")
def sharded(tiny, tmp_path_factory) -> Path:
    """The tiny checkpoint split over 2 shards with an index; tensors alternate between the
    shards, so q/k/v and gate/up of one layer come from different files."""
    out = tmp_path_factory.mktemp("mem") / "sharded"
    out.mkdir()
    from safetensors.torch import save_file

    sd = load_state_dict(tiny, dtype=None)
    names = sorted(sd)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for i, f in enumerate(files):
        save_file({n: sd[n].contiguous() for n in names[i::2]}, str(out / f))
    weight_map = {n: files[i % 2] for i, n in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for f in tiny.iterdir():
        if not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    return out


def _args(path: Path) -> ModelArgs:
    return ModelArgs.from_hf_config(load_model_config(path))


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters()) + model.inv_freq.nbytes


# ---------------------------------------------------------------------------------------------
# plan_kv_blocks: the arithmetic, with a fake mem_get_info


def _plan(free_before: int, **kw):
    baseline = MemorySnapshot(free_before, 80 * GiB, 0, 0)
    # after loading: torch reserves 16.5 GiB; the device lost 0.5 GiB more outside torch
    reserved = kw.pop("reserved", int(16.5 * GiB))
    free_now = free_before - reserved - kw.pop("non_torch", GiB // 2)
    args = dict(utilization=0.9, model_bytes=16 * GiB, peak_activation_bytes=3 * GiB)
    args.update(kw)
    return plan_kv_blocks(
        lambda: (free_now, 80 * GiB),
        args["utilization"],
        args["model_bytes"],
        args["peak_activation_bytes"],
        args.get("bytes_per_block", 2 * MiB + 7),
        baseline=baseline,
        torch_reserved_bytes=reserved,
    )


def test_plan_kv_blocks_arithmetic():
    plan = _plan(78 * GiB)
    # 0.9 x 80 = 72 GiB; minus 2 in use before, 16 model, 3 peak, 0.5 non-torch = 50.5 GiB
    assert plan.budget_bytes == int(72 * GiB)
    assert plan.in_use_before_bytes == 2 * GiB
    assert plan.non_torch_bytes == GiB // 2
    assert plan.kv_cache_bytes == int(50.5 * GiB)
    assert plan.num_kv_blocks == math.floor(50.5 * GiB / (2 * MiB + 7)) == 25855
    assert "25855 blocks" in plan.describe() and "72.00 GiB budget" in plan.describe()


def test_memory_other_processes_use_counts_against_the_budget():
    alone, shared = _plan(78 * GiB), _plan(68 * GiB)  # another process holds 10 GiB more
    assert shared.in_use_before_bytes == 12 * GiB
    assert shared.kv_cache_bytes == alone.kv_cache_bytes - 10 * GiB
    assert shared.num_kv_blocks == math.floor(40.5 * GiB / (2 * MiB + 7))


def test_torch_growth_is_not_counted_as_non_torch():
    plan = _plan(78 * GiB, reserved=30 * GiB, non_torch=0)
    assert plan.non_torch_bytes == 0


def test_plan_error_names_the_numbers_and_the_knobs():
    with pytest.raises(KVCacheMemoryError) as e:
        _plan(78 * GiB, model_bytes=70 * GiB)
    msg = str(e.value)
    for part in ("72.00 GiB budget", "70.00 GiB model", "3.00 GiB peak", "2.00 GiB in use"):
        assert part in msg
    for knob in ("gpu_memory_utilization", "max_num_batched_tokens", "num_kv_blocks"):
        assert knob in msg
    assert e.value.plan.num_kv_blocks == 0 and e.value.plan.kv_cache_bytes < 0
    # less than one block left is an error too, not zero blocks
    with pytest.raises(KVCacheMemoryError):
        _plan(78 * GiB, model_bytes=int(66.5 * GiB) - 10, non_torch=0, bytes_per_block=GiB)


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, True, "0.9"])
def test_gpu_memory_utilization_validated(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)
    if not isinstance(bad, (bool, str)):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            _plan(78 * GiB, utilization=bad)


def test_gpu_memory_utilization_config():
    assert EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1).cache.gpu_memory_utilization == 1.0


def test_dummy_seq_lens():
    assert dummy_seq_lens(2048, 4096, 64) == [2048]
    assert dummy_seq_lens(2048, 512, 64) == [512] * 4
    assert dummy_seq_lens(2048, 512, 2) == [512, 512]
    assert dummy_seq_lens(5, 2, 8) == [2, 2, 1]


# ---------------------------------------------------------------------------------------------
# The model built in its dtype


def test_build_model_allocates_only_in_its_dtype(tiny):
    args = _args(tiny)
    with AllocationProbe() as probe:
        model = build_model(args, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, rope_inv_freq(args))
    wide = [a for a in probe.allocations if a[1] in (torch.float32, torch.float64)]
    assert all(numel <= args.head_dim for _, _, numel in wide), wide  # inv_freq's math only
    assert probe.peak <= _model_bytes(model) + 4096

    # the probe does catch fp32 staging (the old to_empty(device).to(dtype) order)
    with AllocationProbe() as old:
        with torch.device("meta"):
            staged = LlamaForCausalLM(args)
        staged.to_empty(device="cpu").to(torch.bfloat16)
    assert any(
        d == torch.float32 and n == args.vocab_size * args.hidden_size
        for _, d, n in old.allocations
    )


# ---------------------------------------------------------------------------------------------
# Streamed shards


def _eager_load(path: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """The single-file reference: the whole state dict read, then load_weights."""
    model = build_model(_args(path), "cpu", dtype)
    model.load_weights(load_state_dict(path, dtype=dtype))
    return model


def test_sharded_lazy_load_equals_single_file_load(tiny, sharded):
    from transformers import LlamaForCausalLM as HFLlama

    assert len(list(sharded.glob("model-*.safetensors"))) == 2
    got = load_model(sharded, _args(sharded), "cpu", torch.float32)
    want = _eager_load(tiny, torch.float32)
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    hf = HFLlama.from_pretrained(tiny, dtype=torch.float32).state_dict()
    pre = "model.layers.1.self_attn."
    qkv = torch.cat([hf[pre + f"{m}_proj.weight"] for m in "qkv"])
    assert torch.equal(got.layers[1].self_attn.qkv_proj.weight, qkv)


def test_lazy_mapping_reads_each_tensor_once(tiny, sharded):
    lazy = LazyStateDict(sharded)
    names = set(load_state_dict(tiny))
    assert set(lazy) == names and len(lazy) == len(names)
    assert "model.norm.weight" in lazy and "nope" not in lazy
    assert not lazy.num_reads  # headers only so far
    build_model(_args(sharded), "cpu", torch.float32).load_weights(lazy)
    assert lazy.num_reads == Counter(dict.fromkeys(names, 1))
    with pytest.raises(KeyError):
        lazy["nope"]


def test_lazy_mapping_casts_on_access(tiny, sharded):
    ref = load_state_dict(tiny)
    lazy = LazyStateDict(sharded, dtype=torch.bfloat16)
    name = "model.layers.0.mlp.up_proj.weight"
    assert lazy[name].dtype == torch.bfloat16
    assert torch.equal(lazy[name], ref[name].to(torch.bfloat16))


def test_iter_weights_streams_every_tensor_once(tiny, sharded):
    ref = load_state_dict(tiny)
    it = iter_weights(sharded, dtype=torch.float16)
    first_name, first = next(it)  # a generator: one tensor at a time
    got = dict([(first_name, first), *it])
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k].to(torch.float16)) for k in ref)


def test_tensor_in_two_shards_is_an_error(sharded, tmp_path):
    path = shutil.copytree(sharded, tmp_path / "dup")
    from safetensors.torch import load_file, save_file

    one = load_file(str(path / "model-00001-of-00002.safetensors"))
    two = load_file(str(path / "model-00002-of-00002.safetensors"))
    two[next(iter(one))] = next(iter(one.values()))
    save_file(two, str(path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="more than one shard"):
        LazyStateDict(path)
    with pytest.raises(ValueError, match="more than one shard"):
        dict(iter_weights(path))


def test_load_model_holds_no_second_copy_of_the_model(tmp_path):
    # a bf16 checkpoint into an fp32 model: every tensor needs a cast
    path = make_tiny_llama(tmp_path / "bf16", dtype="bfloat16")
    args = _args(path)
    # load_weights' torch.cat of a packed group (bf16 here) lives until the next one replaces
    # it: the largest two in a row are gate/up + down, 3 x intermediate x hidden bf16 values
    group = 3 * args.intermediate_size * args.hidden_size * 2
    with AllocationProbe() as probe:
        model = load_model(path, args, "cpu", torch.float32)
    model_bytes = _model_bytes(model)
    assert probe.peak <= model_bytes + group + 4096, (probe.peak, model_bytes, group)
    ref = load_state_dict(path, dtype=None)
    assert torch.equal(model.norm.weight, ref["model.norm.weight"].float())
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"].float())

    # the probe does catch a whole cast copy of the checkpoint (the old load path)
    with AllocationProbe() as old:
        _eager_load(path, torch.float32)
    assert old.peak >= 1.9 * model_bytes


# ---------------------------------------------------------------------------------------------
# The profiling forward, on the CPU through the real model


@pytest.mark.parametrize("max_loras", [0, 2])
def test_profile_run_executes_and_frees_its_memory(tiny, max_loras):
    args = _args(tiny)
    model = load_model(tiny, args, "cpu", torch.float32)
    if max_loras:
        cfg = EngineConfig(max_loras=max_loras, max_lora_rank=8, max_cpu_loras=max_loras).lora
        spec = LoRAModelSpec(args.num_layers, args.lora_module_shapes(), 8)
        LoRAManager(cfg, spec, model.lora_linears(), torch.device("cpu"), torch.float32)
    backend = RecordingBackend(make_lora_backend("cpu", torch.float32, "torch"))
    caches = [(m.self_attn.k_cache, m.self_attn.v_cache) for m in model.layers]
    num_tokens, max_num_seqs = 40, 4
    with AllocationProbe() as probe:
        before = probe.live
        peak = profile_run(
            model,
            num_tokens=num_tokens,
            max_seq_len=16,
            max_num_seqs=max_num_seqs,
            block_size=8,
            max_loras=max_loras,
            lora_backend=backend,
            meter=ProbeMeter(probe),
        )
        gc.collect()
        assert probe.live == before  # the scratch KV cache and the activations are freed
    assert backend.active_slots == [max_loras]  # one step, LoRA in every slot (or off)
    # at least the gate/up output of the whole batch and the sampled rows' fp32 logits
    assert peak >= num_tokens * 2 * args.intermediate_size * 4
    assert peak >= max_num_seqs * args.vocab_size * 4
    for m, (k, v) in zip(model.layers, caches, strict=True):
        assert m.self_attn.k_cache is k and m.self_attn.v_cache is v
    # without a meter (the CPU engine) it runs and measures nothing
    small = dict(num_tokens=8, max_seq_len=8, max_num_seqs=1, block_size=8, max_loras=max_loras)
    assert profile_run(model, lora_backend=backend, **small) == 0


# ---------------------------------------------------------------------------------------------
# ModelRunner: the CPU keeps kv_cache_memory_gb; the CUDA planning path with fakes


def test_model_runner_cpu_and_planning_wiring(tiny, monkeypatch):
    from engine import model_runner as mr

    config = EngineConfig(
        model=str(tiny), device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.01, max_loras=2
    )
    runner = mr.ModelRunner(config, tiny)
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    bpb = runner._kv_bytes_per_block()
    assert bpb == 2 * runner.args.num_layers * 16 * runner.args.num_kv_heads * 16 * 2
    assert runner.num_kv_blocks == int(0.01 * GiB) // bpb and runner.memory_plan is None

    # the CUDA branch: a fake device of 1 GiB, 100 MiB used by others, nothing outside torch
    probe = AllocationProbe()
    monkeypatch.setattr(mr, "CudaMeter", lambda device: ProbeMeter(probe))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB - 100 * MiB, GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    baseline = MemorySnapshot(GiB - 100 * MiB, GiB, 0, 0)
    with probe:
        blocks = runner._blocks_for_memory(baseline)
    plan = runner.memory_plan
    assert plan is not None and blocks == plan.num_kv_blocks and plan.bytes_per_block == bpb
    assert plan.model_bytes == 0  # the probe started after the model was loaded
    assert plan.peak_activation_bytes > 0 and plan.in_use_before_bytes == 100 * MiB
    want = (int(0.9 * GiB) - 100 * MiB - plan.peak_activation_bytes) // bpb
    assert blocks == want
