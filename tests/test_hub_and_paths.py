"""engine.hub (telling a Hub repo id from a path, the Hub's errors) and engine.paths (the cache
root), and that both import without torch: serve_app checks its arguments with them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import hub, paths

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "spec",
    [
        "/abs/folder",
        "./rel",
        "../up",
        ".",
        "~/adapters/caps",
        "a/b/c",  # a repo id has one slash at most
        "C:\\adapters\\caps",
        "C:/adapters/caps",
        "with space/name",
        "-dash/name",
    ],
)
def test_what_cannot_be_a_repo_id_is_a_path(spec):
    assert hub.looks_like_local_path(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "gpt2",
        "HuggingFaceTB/SmolLM2-135M",
        "owner/name@main",
        "o/n.v1_2@0123abc",
        "owner/name@refs/pr/1",
    ],
)
def test_repo_ids(spec):
    assert not hub.looks_like_local_path(spec)


def test_split_revision():
    assert hub.split_revision("owner/name@v2") == ("owner/name", "v2")
    assert hub.split_revision("owner/name") == ("owner/name", None)
    assert hub.split_revision("owner/name@") == ("owner/name", None)


def test_snapshot_passes_the_revision_and_maps_the_hubs_errors(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub.errors import RevisionNotFoundError

    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw["revision"], kw["allow_patterns"]))
        if kw["revision"] == "gone":
            err = RevisionNotFoundError.__new__(RevisionNotFoundError)  # no HTTP response
            Exception.__init__(err, "no such revision")
            raise err
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert hub.snapshot("o/n@v1", "model 'o/n@v1'", ["*.json"]) == tmp_path
    assert calls == [("o/n", "v1", ["*.json"])]
    with pytest.raises(FileNotFoundError, match="revision 'gone' of 'o/n' does not exist"):
        hub.snapshot("o/n@gone", "model 'o/n@gone'", ["*.json"])


def test_an_adapter_repo_with_a_revision(monkeypatch, tmp_path):
    """A LoRARequest's lora_path may name a revision, as a model may."""
    import huggingface_hub

    from engine.lora.adapter import resolve_adapter_dir

    seen = []
    monkeypatch.setattr(
        huggingface_hub,
        "snapshot_download",
        lambda repo_id, **kw: seen.append((repo_id, kw["revision"])) or str(tmp_path),
    )
    assert resolve_adapter_dir("someone/adapter@abc123", "a") == tmp_path
    assert seen == [("someone/adapter", "abc123")]


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.ENV_CACHE, str(tmp_path / "c"))
    assert paths.cache_dir() == tmp_path / "c"
    assert paths.adapters_dir() == tmp_path / "c" / "adapters"
    monkeypatch.delenv(paths.ENV_CACHE)
    assert paths.cache_dir() == Path.home() / ".cache" / "raylora"


def test_serve_app_and_the_ingress_import_without_torch():
    """The ingress and serve_app's argument checks run where torch is not wanted (the
    ingress's replicas): importing them, engine.hub and engine.paths included, loads none."""
    code = (
        "import sys; import serve_app, deployments.ingress, engine.hub, engine.paths; "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "from engine import LLMEngine; assert 'torch' in sys.modules"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-2000:]
