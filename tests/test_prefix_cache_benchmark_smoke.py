"""Smoke run of benchmarks/prefix_cache.py on the tiny model with tiny sizes: the script runs
end to end, caching changes no greedy token, and the cache is hit (the targets need the
default model, see docs/benchmarks.md). And its workload builder, which the Serve-app
benchmark reuses: per-tenant system prompts that really are shared prefixes."""

import pytest
from transformers import AutoTokenizer

from benchmarks import prefix_cache

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_workload_tenants_share_their_system_prompt(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    reqs = prefix_cache.build_workload(tok, num_requests=12, num_adapters=2, system_len=64)
    assert len(reqs) == 12 and {r.tenant for r in reqs} == {0, 1, 2}
    assert {r.lora_name for r in reqs} == {"pc-lora-0", "pc-lora-1", None}
    for r in reqs:
        assert r.messages[0]["role"] == "system" and r.messages[1]["role"] == "user"
        system_ids = tok(r.messages[0]["content"]).input_ids
        assert abs(len(system_ids) - 64) <= 2  # cut at 64 tokens, re-encoded
    for a in reqs:
        for b in reqs:
            if a is b:
                continue
            shared = common_prefix(a.prompt_token_ids, b.prompt_token_ids)
            if a.tenant == b.tenant:
                assert shared >= 60, (a.req_id, b.req_id, shared)
            else:
                assert shared < 32, (a.req_id, b.req_id, shared)  # the chat template's opening


def test_prefix_cache_benchmark_smoke(tiny_model_dir, capsys):
    r = prefix_cache.main(
        [
            "--model",
            tiny_model_dir,
            "--num-requests",
            "10",
            "--num-adapters",
            "2",
            "--rank",
            "4",
            "--system-len",
            "64",
            "--output-len",
            "4",
            "--alternations",
            "2",
            "--max-num-batched-tokens",
            "256",
            "--kv-cache-gb",
            "0.1",
            "--threads",
            "1",
        ]
    )
    assert r["ttft_p50_ratio"] > 0 and r["throughput_ratio"] > 0 and r["tok_s_on"] > 0
    # greedy fp32 on the tiny model: caching changes no token
    assert r["identical"] == r["num_outputs"] == 20
    assert r["cached_tokens_off"] == 0 and r["cached_tokens_on"] > 0
    # each request's num_cached_tokens is its one lookup's hits (no fan-out, no preemption)
    assert r["stats"]["on"]["num_preemptions"] == 0
    assert r["prefix_cache_hits"] == 2 * r["cached_tokens_on"]
    out = capsys.readouterr().out
    assert "ratio TTFT p50 off / on" in out and "ratio throughput on / off" in out
