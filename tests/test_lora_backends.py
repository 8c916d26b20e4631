"""raylora_kernels/backends: the torch (CPU) and Triton (interpreter) LoRA backends against an independent
reference (the base GEMM in float64, then lora_shrink_ref / lora_expand_ref per token in fp32),
on decode- and prefill-shaped batches, with and without base rows, plain and packed weights;
and the route chosen once: make_lora_backend once per engine, prepare once per forward context,
nothing resolved per linear."""

import importlib
import zlib

import pytest
import torch

import raylora_kernels.backends.cpu as cpu_backend
from engine.models.llama import ForwardContext, LoRALinear
from raylora_kernels import (
    LoRABatchMeta,
    SlotWeights,
    lora_expand_ref,
    lora_shrink_ref,
    make_lora_backend,
)
from raylora_kernels.backends import CppOps, CPULoRABackend, TritonLoRABackend, cpp_ops
from raylora_kernels.packed_weight import PackedWeight

lora_linear_mod = importlib.import_module(
    "raylora_kernels.lora_linear"
)  # `raylora_kernels.lora_linear`: the op

L, R = 4, 8  # slot 3 is never used: it holds NaN garbage
WIDTHS = {"qkv": (64, [64, 16, 16]), "one": (48, [40])}

# (slot, count) runs, grouped by slot as the model runner orders them, base tokens (-1) last
BATCHES = {
    "decode": [(0, 1), (1, 1), (2, 1)],  # every token an adapter's: the C++ kernel or addmm
    "decode_base_rows": [(0, 1), (2, 1), (-1, 2)],
    "decode_two_per_slot": [(0, 2), (2, 2)],
    "prefill": [(0, 20), (2, 5)],
    "prefill_base_rows": [(0, 3), (1, 18), (-1, 6)],
    "past_the_kernel_cap": [(1, 4097), (-1, 3)],  # past _CPU_KERNEL_MAX_TOKENS: torch ops
    "unsorted": None,  # not grouped by slot (the per-call functions take such batches)
}
# sorted, at most _CPU_KERNEL_MAX_TOKENS (4,096) a slot: the C++ kernel
KERNEL_BATCHES = {
    "decode",
    "decode_base_rows",
    "decode_two_per_slot",
    "prefill",
    "prefill_base_rows",
}


def _slots(batch: str, gen: torch.Generator) -> torch.Tensor:
    runs = BATCHES[batch]
    if runs is None:
        slots = torch.randint(-1, L - 1, (19,), generator=gen)
        slots[:3] = torch.tensor([-1, 2, 0])  # unsorted for sure
        return slots.to(torch.int32)
    return torch.tensor([s for s, n in runs for _ in range(n)], dtype=torch.int32)


def _weights(widths_key: str, dtype: torch.dtype, gen: torch.Generator) -> SlotWeights:
    hidden_in, widths = WIDTHS[widths_key]
    w = SlotWeights.zeros(L, R, hidden_in, widths, dtype=dtype)
    w.a.copy_(torch.randn(w.a.shape, generator=gen) * hidden_in**-0.5)
    w.b_t.copy_(torch.randn(w.b_t.shape, generator=gen) * R**-0.5)
    w.a[L - 1].fill_(float("nan"))  # an inactive slot's garbage must not leak
    w.b_t[L - 1].fill_(float("nan"))
    return w


def _counting(ops: CppOps, calls: list[str]) -> CppOps:
    def counted(name):
        op = getattr(ops, name)
        return lambda *args: calls.append(name) or op(*args)

    return CppOps(**{f: counted(f) for f in CppOps.__dataclass_fields__})


def _backend(mode: str, monkeypatch, calls: list[str]):
    if mode == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return TritonLoRABackend(None)  # F.linear for the base GEMM (CUDA's case)
    if mode == "torch_ops":
        return CPULoRABackend(None)
    ops = cpp_ops("cpu", torch.float32)
    assert ops is not None, "the C++ CPU kernels did not build (see the logged warning)"
    return CPULoRABackend(_counting(ops, calls))


def _case(widths_key: str, batch: str, bias: bool, lora_dtype=torch.float32):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{widths_key}/{batch}/{bias}".encode()))
    w = _weights(widths_key, lora_dtype, gen)
    slots = _slots(batch, gen)
    hidden_in, out = w.a.shape[2], sum(w.widths)
    x = torch.randn(len(slots), hidden_in, generator=gen)
    weight = torch.randn(out, hidden_in, generator=gen) * hidden_in**-0.5
    b = torch.randn(out, generator=gen) if bias else None
    base = x.double() @ weight.double().T
    if b is not None:
        base += b.double()
    wide = SlotWeights(w.a.float(), w.b_t.float(), w.widths)  # the values, in fp32
    ref = lora_expand_ref(lora_shrink_ref(x, wide.lora_a, slots), wide.lora_b, slots, base.float())
    return w, slots, x, weight, b, ref


@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops", "triton"])
@pytest.mark.parametrize("weight_kind", ["plain", "packed"])
@pytest.mark.parametrize("widths_key", sorted(WIDTHS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_linear_matches_reference(monkeypatch, mode, weight_kind, widths_key, batch):
    calls: list[str] = []
    backend = _backend(mode, monkeypatch, calls)
    bias = weight_kind == "packed"  # packed with a bias (qkv of Qwen2), plain without
    w, slots, x, weight, b, ref = _case(widths_key, batch, bias)
    if weight_kind == "packed":
        weight = PackedWeight.pack(weight)
    meta = LoRABatchMeta.build(slots, L)
    assert meta.tokens_sorted == (batch != "unsorted")
    add_lora_calls = []
    real_add = type(backend).add_lora
    monkeypatch.setattr(
        type(backend), "add_lora", lambda s, *a: add_lora_calls.append(1) or real_add(s, *a)
    )
    step = backend.prepare(meta)
    y = step.linear(x, weight, b, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    base_rows = (slots < 0).nonzero().flatten()
    assert torch.equal(y[base_rows], step.base(x, weight, b)[base_rows])  # untouched
    kernel_batch = batch in KERNEL_BATCHES
    if mode == "cpu_kernel":  # decode-shaped: the base GEMM and the LoRA in one C++ call
        lora_op = "linear_lora_packed" if weight_kind == "packed" else "linear_lora"
        assert [c for c in calls if "lora" in c] == [lora_op] * kernel_batch
    if mode == "torch_ops":  # every token an adapter's, plain weight: delta, then addmm onto it
        fused = batch in ("decode", "decode_two_per_slot") and weight_kind == "plain"
        assert len(add_lora_calls) == (not fused)
    # the unprepared backend, and a step without adapter tokens: the base GEMM alone
    no_lora = LoRABatchMeta.build(torch.full_like(slots, -1), L)
    base_ref = _base_ref(x, weight, b)
    for base_only in (backend, backend.prepare(None), backend.prepare(no_lora)):
        assert base_only.meta is None
        torch.testing.assert_close(
            base_only.linear(x, weight, b, w), base_ref, rtol=1e-5, atol=1e-5
        )


def _base_ref(x, weight, b) -> torch.Tensor:
    plain = weight.unpack() if isinstance(weight, PackedWeight) else weight
    base = x.double() @ plain.double().T
    return (base if b is None else base + b.double()).float()


@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops", "triton"])
@pytest.mark.parametrize("batch", ["decode_base_rows", "prefill_base_rows", "unsorted"])
def test_add_lora_leaves_base_rows_untouched(monkeypatch, mode, batch):
    calls: list[str] = []
    backend = _backend(mode, monkeypatch, calls)
    w, slots, x, _, _, _ = _case("qkv", batch, False)
    y = torch.randn(len(slots), sum(w.widths), generator=torch.Generator().manual_seed(3))
    ref = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, y)
    y0 = y.clone()
    backend.prepare(LoRABatchMeta.build(slots, L)).add_lora(x, y, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    base_rows = (slots < 0).nonzero().flatten()
    assert len(base_rows) > 0 and torch.equal(y[base_rows], y0[base_rows])
    if mode == "cpu_kernel":
        assert calls == ["lora_add"] * (batch in KERNEL_BATCHES)


@pytest.mark.parametrize("mode", ["cpu_kernel", "triton"])
def test_kernels_read_each_slots_rank(monkeypatch, mode):
    """The backend hands the kernels each slot's ranks (SlotWeights.ranks to the C++ kernel,
    ranks_device to Triton): rows past them hold garbage here (the LoRA manager keeps them
    zero), so the result is the reference on the weights cut to those ranks."""
    backend = _backend(mode, monkeypatch, [])
    w, slots, x, weight, b, _ = _case("qkv", "decode_base_rows", False)
    w.ranks = torch.tensor([[8, 3, 0], [1, 1, 1], [5, 0, 8], [8, 8, 8]])
    w.sync_ranks()
    cut = SlotWeights(w.a.clone(), w.b_t.clone(), w.widths)
    for slot, row in enumerate(w.ranks.tolist()):
        for s, r in enumerate(row):
            cut.lora_a[s][slot, r:] = 0
            cut.lora_b[s][slot, :, r:] = 0
    base = (x.double() @ weight.double().T).float()
    ref = lora_expand_ref(lora_shrink_ref(x, cut.lora_a, slots), cut.lora_b, slots, base)
    full = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, base)
    assert not torch.allclose(ref, full)  # the garbage matters: ignoring ranks would fail
    y = backend.prepare(LoRABatchMeta.build(slots, L)).linear(x, weight, b, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["cpu_kernel", "torch_ops"])
@pytest.mark.parametrize("batch", ["decode_base_rows", "prefill_base_rows"])
def test_bf16_slots_under_an_fp32_model(monkeypatch, mode, batch):
    """lora_dtype="bfloat16": the C++ kernel reads bf16 weights, the torch ops widen them; the
    math is fp32 either way, so the reference is the fp32 one on the same (rounded) values."""
    calls: list[str] = []
    backend = _backend(mode, monkeypatch, calls)
    w, slots, x, weight, b, ref = _case("qkv", batch, True, lora_dtype=torch.bfloat16)
    y = backend.prepare(LoRABatchMeta.build(slots, L)).linear(x, weight, b, w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if mode == "cpu_kernel":
        assert [c for c in calls if "lora" in c] == ["linear_lora"] * (batch in KERNEL_BATCHES)


def test_triton_backend_takes_a_static_meta(monkeypatch):
    """The graph-safe meta (fixed shapes, every slot; CUDA graphs) through the same backend: the
    public lora_shrink / lora_expand pick its launch."""
    if not hasattr(LoRABatchMeta, "build_static"):
        pytest.skip("no StaticLoRAMeta in raylora_kernels/metadata.py")
    backend = _backend("triton", monkeypatch, [])
    w, slots, x, weight, b, ref = _case("qkv", "decode_base_rows", True)
    step = backend.prepare(LoRABatchMeta.build_static(slots, L))
    torch.testing.assert_close(step.linear(x, weight, b, w), ref, rtol=1e-5, atol=1e-5)


def test_make_lora_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert make_lora_backend("cpu", torch.float32, "auto").name == "torch"
    assert make_lora_backend("cpu", torch.float32, "torch").ops is not None  # the C++ kernels
    assert make_lora_backend("cpu", torch.bfloat16, "torch").ops is None  # they take fp32 only
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_lora_backend("cpu", torch.float32, "triton")
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_lora_backend("cpu", torch.float32, "triton").name == "triton"


@pytest.mark.parametrize("mode", ["cpu_kernel", "triton"])
def test_route_is_chosen_once(monkeypatch, mode):
    """A forward context prepares the backend once; its LoRA linears then only call it: no
    backend resolution, no C++ op lookup per linear. Each context keeps its own step."""
    calls: list[str] = []
    backend = _backend(mode, monkeypatch, calls)
    prepares = []
    real_prepare = type(backend).prepare
    monkeypatch.setattr(
        type(backend), "prepare", lambda s, m: prepares.append(m) or real_prepare(s, m)
    )
    layers = []
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        lin = LoRALinear(64, [64, 16, 16])
        lin.weight.data.copy_(torch.randn(96, 64, generator=gen) * 0.125)
        lin.lora = _weights("qkv", torch.float32, gen)
        layers.append(lin)
    slots = _slots("decode_base_rows", gen)
    other = _slots("prefill", gen)
    x = torch.randn(len(slots), 64, generator=gen)
    ctx = ForwardContext(attn=None, lora=LoRABatchMeta.build(slots, L), lora_backend=backend)
    ctx_other = ForwardContext(attn=None, lora=LoRABatchMeta.build(other, L), lora_backend=backend)
    assert len(prepares) == 2

    def forbidden(*args, **kwargs):
        raise AssertionError("the route was re-decided inside a forward")

    for name in ("cpu_lora_op", "cpu_linear_lora_op", "cpu_linear_lora_packed_op"):
        monkeypatch.setattr(cpu_backend, name, forbidden)
    monkeypatch.setattr(cpu_backend, "cpp_ops", forbidden)
    monkeypatch.setattr(lora_linear_mod, "cpp_ops", forbidden)
    monkeypatch.setattr(lora_linear_mod, "resolve_backend", forbidden)
    with torch.inference_mode():
        outs = [layer(x, ctx) for layer in layers for _ in range(2)]
    assert len(prepares) == 2  # none during the forward
    for layer, y in zip(layers, outs[::2], strict=True):
        w = layer.lora
        base = x.double() @ layer.weight.double().T
        ref = lora_expand_ref(lora_shrink_ref(x, w.lora_a, slots), w.lora_b, slots, base.float())
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if mode == "cpu_kernel":
        assert calls == ["linear_lora"] * 6
    assert ctx.lora_backend.meta is ctx.lora and ctx_other.lora_backend.meta is ctx_other.lora


def test_engine_builds_one_backend_and_prepares_it_once_per_forward(
    tiny_model_dir, tmp_path, monkeypatch
):
    """make_lora_backend runs once, in ModelRunner.__init__; every forward's context prepares it
    once (the adapter steps with a batch that has adapter tokens), and no linear resolves a
    backend. The adapter must change the tokens, else the LoRA could have been skipped."""
    import engine.model_runner as model_runner_mod
    from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
    from engine.models.llama import LlamaForCausalLM
    from tests.lora_fixtures import make_peft_adapter

    path = make_peft_adapter(tiny_model_dir, tmp_path / "a", r=8, target_modules=["q_proj"])
    made, prepared, forwards = [], [], []
    real_make = model_runner_mod.make_lora_backend
    monkeypatch.setattr(
        model_runner_mod, "make_lora_backend", lambda *a: made.append(a) or real_make(*a)
    )
    real_prepare = CPULoRABackend.prepare
    monkeypatch.setattr(
        CPULoRABackend, "prepare", lambda s, m: prepared.append(m) or real_prepare(s, m)
    )
    real_hidden = LlamaForCausalLM.hidden_states
    monkeypatch.setattr(
        LlamaForCausalLM,
        "hidden_states",
        lambda s, ids, pos, ctx, rows: forwards.append(ctx) or real_hidden(s, ids, pos, ctx, rows),
    )
    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, max_loras=1, max_lora_rank=8, block_size=4)
    )
    assert len(made) == 1 and engine.model_runner.lora_backend.name == "torch"

    def forbidden(*args):
        raise AssertionError("a linear resolved its LoRA backend")

    monkeypatch.setattr(lora_linear_mod, "resolve_backend", forbidden)
    params = SamplingParams(temperature=0, max_tokens=4)
    lora = LoRARequest("a", 1, str(path))
    engine.add_request("lora", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params, lora)
    engine.add_request("base", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert len(made) == 1
    assert forwards and len(prepared) == len(forwards)
    assert all(ctx.lora_backend.meta is ctx.lora for ctx in forwards if ctx.lora is not None)
    assert any(m is not None and m.num_lora_tokens > 0 for m in prepared)
    assert done["lora"] != done["base"]
