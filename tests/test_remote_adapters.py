"""Adapters from object storage (engine/remote.py): an S3 bucket served over HTTP on loopback
by moto's S3 server and read by s3fs as from AWS (tests/s3_fixtures.py). The reference is the
same adapter read from its local folder; through the Serve app: tests/test_remote_serve.py."""

import os

import pytest
import torch

import engine.remote
from engine.lora.adapter import load_adapter, resolve_adapter_dir
from engine.lora.errors import LoRANotFoundError
from engine.lora.peft_config import LoRAModelSpec
from tests.s3_fixtures import moto_s3, upload
from tests.serve_fixtures import make_tiny_adapter

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as fs:
        yield fs


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLORA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "remote"


def _spec(model_dir: str) -> LoRAModelSpec:
    from transformers import AutoConfig

    return LoRAModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir), max_lora_rank=16)


def _same_weights(a, b) -> bool:
    return a.weights.keys() == b.weights.keys() and all(
        torch.equal(x, y)
        for k in a.weights
        for x, y in zip(a.weights[k], b.weights[k], strict=True)
    )


def test_adapter_from_s3_equals_its_local_folder_and_is_fetched_once(
    s3, cache, tiny_model_dir, tmp_path, monkeypatch
):
    local = make_tiny_adapter(tiny_model_dir, tmp_path / "a", 4, ["q_proj", "v_proj"], 1)
    url = upload(s3, local, "a")
    spec = _spec(tiny_model_dir)
    remote = load_adapter(url, "a", spec)
    assert _same_weights(remote, load_adapter(str(local), "a", spec))
    assert remote.source == url and remote.rank == 4
    folder = resolve_adapter_dir(url, "a")
    assert folder.parent == cache and len(os.listdir(cache)) == 1
    # the config and weights, byte for byte; nothing else of the folder (a README)
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors"]
    for f in os.listdir(folder):
        assert (folder / f).read_bytes() == (local / f).read_bytes()
    # unchanged in the bucket: read from the local copy (the same folder, nothing new)
    assert resolve_adapter_dir(url + "/", "a") == folder and len(os.listdir(cache)) == 1
    # overwritten in the bucket: fetched again
    other = make_tiny_adapter(tiny_model_dir, tmp_path / "b", 4, ["q_proj", "v_proj"], 2)
    upload(s3, other, "a")
    again = load_adapter(url, "a", spec)
    assert _same_weights(again, load_adapter(str(other), "a", spec))
    assert (
        not _same_weights(again, remote) and len(os.listdir(cache)) == 2
    )  # the old one used lately
    # a third version lands when the others were last used over PRUNE_AFTER_S ago: they go
    monkeypatch.setattr(engine.remote, "PRUNE_AFTER_S", 0.0)
    newest = make_tiny_adapter(tiny_model_dir, tmp_path / "c", 4, ["q_proj", "v_proj"], 8)
    upload(s3, newest, "a")  # other bytes (the same bytes within a second are one version)
    third = resolve_adapter_dir(url, "a")
    assert os.listdir(cache) == [third.name] and (third / "adapter_config.json").is_file()
    assert _same_weights(load_adapter(url, "a", spec), load_adapter(str(newest), "a", spec))


def test_what_is_not_an_adapter_in_the_bucket_is_not_found(s3, cache, tiny_model_dir, tmp_path):
    local = make_tiny_adapter(tiny_model_dir, tmp_path / "c", 4, ["q_proj"], 3)
    s3.put_file(
        str(local / "adapter_model.safetensors"), "loras/weights-only/adapter_model.safetensors"
    )
    for url, says in [
        ("s3://loras/nope", "does not exist"),
        ("s3://no-such-bucket/x", "s3://no-such-bucket/x"),
        ("s3://loras/weights-only", "has no adapter_config.json"),
        ("nosuchfs://loras/x", "no file system for nosuchfs://"),
    ]:
        with pytest.raises(LoRANotFoundError, match=says):
            resolve_adapter_dir(url, "x")
    assert not cache.exists() or os.listdir(cache) == []


def test_engine_serves_an_s3_adapter_as_it_serves_the_local_folder(
    s3, cache, tiny_model_dir, tmp_path
):
    from engine import LLM, LoRARequest, SamplingParams

    local = make_tiny_adapter(tiny_model_dir, tmp_path / "d", 8, ["q_proj", "down_proj"], 4)
    url = upload(s3, local, "d")
    llm = LLM(tiny_model_dir, max_loras=2, max_cpu_loras=2, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8)
    outs = [
        llm.generate("Hello there", params, lora_request=LoRARequest(name, i + 1, path))[0]
        for i, (name, path) in enumerate([("d-local", str(local)), ("d-s3", url)])
    ]
    base = llm.generate("Hello there", params)[0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != base.outputs[0].token_ids  # the adapter matters


def test_a_folder_written_while_it_is_copied_is_copied_again(
    s3, cache, tiny_model_dir, tmp_path, monkeypatch
):
    """The folder is overwritten (another rank, other modules) after its config was copied and
    before its weights were: the copy would pair the old config with the new weights."""
    import fsspec

    old = make_tiny_adapter(tiny_model_dir, tmp_path / "old", 4, ["q_proj"], 6)
    new = make_tiny_adapter(tiny_model_dir, tmp_path / "new", 8, ["k_proj", "up_proj"], 7)
    url = upload(s3, old, "racy")
    fs = fsspec.core.url_to_fs(url)[0]  # fsspec's cached instance: the one fetch_folder gets
    real, copied = fs.get_file, []

    def get_file(rpath, lpath, **kwargs):
        out = real(rpath, lpath, **kwargs)
        copied.append(rpath)
        if len(copied) == 1:
            upload(s3, new, "racy")
        return out

    monkeypatch.setattr(fs, "get_file", get_file)
    spec = _spec(tiny_model_dir)
    assert _same_weights(load_adapter(url, "racy", spec), load_adapter(str(new), "racy", spec))
    assert len(copied) == 4 and len(os.listdir(cache)) == 1  # two copies made, one kept
    with pytest.raises(LoRANotFoundError, match="names no folder"):
        resolve_adapter_dir("s3://", "x")
