"""The static-buffer decode path (engine/static_decode.py, decode_inputs.py, cuda_graphs.py).

Decode-only steps read persistent buffers; on a GPU they replay from CUDA graphs. Here: the
path equals the eager list-built path token for token (greedy and seeded sampling, LoRA mixes,
padded rows), PEFT parity holds through it, and the capture logic is checked with EagerGraph,
which replays the capture-time closure as a real graph would, so a forward that baked a
per-step value (an adapter mix, a batch's lengths) into its capture gives wrong tokens here.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.attention import sdpa_decode_attention
from engine.cuda_graphs import DecodeGraphs, EagerGraph
from engine.decode_inputs import DecodeInputs, capture_sizes
from engine.static_decode import StaticDecode
from tests.lora_fixtures import make_adapter_set
from tests.test_lora_engine import check_parity, lora_requests, parity_engine, run_checked, workload

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    paths = make_adapter_set(tiny_model_dir, tmp_path_factory.mktemp("adapters"))
    return {k: str(v) for k, v in paths.items()}


def _replace_static(engine: LLMEngine, **kwargs) -> StaticDecode:
    runner = engine.model_runner
    op = runner.decode_attention or sdpa_decode_attention
    runner.static_decode = StaticDecode(runner, op, engine.config.max_model_len, **kwargs)
    return runner.static_decode


def _outputs(engine: LLMEngine, adapters, params: SamplingParams) -> dict[str, list[int]]:
    return run_checked(engine, workload(lora_requests(adapters)), params, engine.config.max_loras)


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_static_path_equals_the_eager_path(tiny_model_dir, adapters, params):
    eager = parity_engine(tiny_model_dir)
    eager.model_runner.static_decode = None  # every step through the list-built path
    ref = _outputs(eager, adapters, params)
    static = parity_engine(tiny_model_dir)
    assert static.model_runner.static_decode is not None  # the default
    assert _outputs(static, adapters, params) == ref
    assert static.model_runner.static_decode.steps > 0
    padded = parity_engine(tiny_model_dir)
    sd = _replace_static(padded, pad_sizes=[1, 2, 4, 8])
    assert _outputs(padded, adapters, params) == ref
    assert sd.steps > 0


def test_peft_parity_through_eager_graph_replays(tiny_model_dir, adapters):
    """Graphs captured once per (size, LoRA on/off) at start-up with padding inputs, then
    replayed under every adapter mix and batch of the parity workload."""
    engine = parity_engine(tiny_model_dir)
    sd = _replace_static(engine, graph_factory=EagerGraph)
    assert set(sd.graphs.graphs) == {(s, lora) for s in (1, 2, 4, 8) for lora in (False, True)}
    check_parity(tiny_model_dir, adapters, engine)
    replays = sd.graphs.replays
    assert sum(replays.values()) == sd.steps > 0
    assert any(lora for _, lora in replays)  # (base-only replays: the head_dim-64 test)


def test_triton_lora_graph_replays_under_the_interpreter(tiny_model_dir, adapters, monkeypatch):
    """The CUDA configuration on the CPU: Triton LoRA kernels with the static (sync-free)
    slot grouping recomputed inside the captured forward, one launch grid per capture size."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = parity_engine(tiny_model_dir, lora_backend="triton")
    sd = _replace_static(engine, graph_factory=EagerGraph)
    check_parity(tiny_model_dir, adapters, engine, max_tokens=4)
    assert any(lora and n for (_, lora), n in sd.graphs.replays.items())


def test_head_dim_64_model_takes_the_cpp_kernels(tmp_path, adapters):
    """A model the C++ decode attention takes (head_dim 64): the fused decode layers and the
    C++ attention read the persistent buffers, padded or not, with and without graphs."""
    from tests.model_fixtures import make_tiny_llama

    model = str(make_tiny_llama(tmp_path / "hd64", hidden_size=128, num_attention_heads=2))
    prompts = [{"prompt_token_ids": list(range(5, 9 + 7 * i))} for i in range(6)]

    def run(setup) -> list[list[int]]:
        engine = parity_engine(model)
        setup(engine)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        return [done[str(i)] for i in range(len(prompts))]

    def off(engine):
        engine.model_runner.static_decode = None

    ref = run(off)
    engine = parity_engine(model)
    if engine.model_runner.decode_attention is None:
        pytest.skip("the C++ CPU kernels are not built here")
    assert run(lambda e: None) == ref
    assert run(lambda e: _replace_static(e, pad_sizes=[2, 8])) == ref
    assert run(lambda e: _replace_static(e, graph_factory=EagerGraph)) == ref


def test_decode_inputs_one_buffer_and_padding_rows():
    inputs = DecodeInputs(8, 5, 4, null_block=9, device=torch.device("cpu"), pad_sizes=[2, 4, 8])
    step = inputs.stage([(11, 5, [3, 7], 1), (12, 0, [2], -1), (13, 16, [1, 2, 3, 4, 6], 0)])
    assert step.num_seqs == 3 and step.padded == 4 and step.max_blocks == 5
    base = inputs.host.data_ptr()
    for t in (step.input_ids, step.positions, step.slot_mapping, step.context_lens):
        assert base <= t.data_ptr() < base + inputs.host.numel()  # views of the one buffer
    assert step.input_ids.tolist() == [11, 12, 13, 0]
    assert step.positions.tolist() == [5, 0, 16, 0]
    # slot = table[p // bs] * bs + p % bs; the padding row writes the null block's first slot
    assert step.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4, 6 * 4, 9 * 4]
    assert step.context_lens.tolist() == [6, 1, 17, 1]
    assert step.token_slots.tolist() == [1, -1, 0, -1]
    assert step.block_tables[0, :2].tolist() == [3, 7] and step.block_tables[3, 0] == 9
    # a smaller step next: stale rows past it are padding again
    step = inputs.stage([(1, 3, [4], 2)])
    assert step.padded == 2 and step.token_slots.tolist() == [2, -1]
    with pytest.raises(AssertionError, match="needs 2 blocks"):
        inputs.stage([(1, 4, [4], -1)])
    with pytest.raises(AssertionError, match="max_num_seqs"):
        inputs.stage([(1, 0, [4], -1)] * 9)


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def test_graphs_capture_largest_first_in_one_pool():
    captured: list[tuple[int, bool, object]] = []

    class FakeGraph(EagerGraph):
        def capture(self, fn, pool):
            captured.append((*fn.key, pool))
            return super().capture(fn, pool)

        def pool(self):
            return "pool"

    def build(size, lora):
        def fn():
            return torch.full((size,), float(lora))

        fn.key = (size, lora)
        return fn

    graphs = DecodeGraphs(build, [1, 4, 2], (False, True), FakeGraph)
    graphs.capture()
    assert [(s, lora) for s, lora, _ in captured] == [
        (4, False),
        (4, True),
        (2, False),
        (2, True),
        (1, False),
        (1, True),
    ]
    assert [p for _, _, p in captured] == [None] + ["pool"] * 5
    assert graphs.replay(2, True).tolist() == [1.0, 1.0]


def test_cuda_graph_keeps_its_closure_alive(monkeypatch):
    """A CUDA graph replays raw addresses, so whatever its closure alone holds (a LoRA graph's
    StaticLoRAMeta) must live as long as the graph. Before CudaGraph kept fn, those buffers
    were freed after capture and reused: on the H200 (2026-12-04) the first LoRA replay read
    garbage slot counts, an illegal address. torch.cuda's graph pieces need a GPU; stood in
    here by no-ops, CudaGraph's own bookkeeping is what is checked."""
    import gc
    import weakref
    from contextlib import nullcontext

    from engine import cuda_graphs

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return "pool"

    cuda = cuda_graphs.torch.cuda
    monkeypatch.setattr(cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(cuda, "Stream", Stream)
    monkeypatch.setattr(cuda, "current_stream", Stream)
    monkeypatch.setattr(cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(cuda, "graph", lambda g, pool=None: nullcontext())

    def build(size, lora):
        held = torch.zeros(size)  # only the closure refers to it, as the static meta

        def forward():
            return held + 1

        build.refs.append(weakref.ref(held))
        return forward

    build.refs = []
    graphs = DecodeGraphs(build, [1, 2], (False, True), cuda_graphs.CudaGraph)
    graphs.capture()
    gc.collect()
    assert len(build.refs) == 4 and all(r() is not None for r in build.refs)
    del graphs
    gc.collect()
    assert all(r() is None for r in build.refs)  # and freed with the graphs, not leaked
