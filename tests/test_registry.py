"""RegistryState without Ray (in memory, over a FileStore, over fake stores); FileStore's
atomic writes and corrupt records; the real actor on a local cluster, killed and restarted
by Ray, over the GCS KV and over a file: the catalog is back at once and an unload stays."""

import json
import os
import time

import pytest

from deployments.catalog_store import CatalogStoreError, FileStore
from deployments.registry import RegistryState

SPEC = {"source": "/ad/a", "rank": 8, "target_modules": ["q_proj", "v_proj"], "base_model": "m"}
SPEC2 = {**SPEC, "source": "/ad/a2", "rank": 4}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_catalog_register_unregister_list():
    s = RegistryState()
    s.register_adapter("a", **SPEC)
    assert s.list_adapters() == {"a": SPEC}
    v = s.version
    s.register_adapter("a", **SPEC)  # same spec: no change
    assert s.version == v
    assert s.unregister_adapter("a") is True
    assert s.unregister_adapter("a") is False
    assert s.list_adapters() == {}
    with pytest.raises(ValueError):
        s.register_adapter("b", "/ad/b", 0, [], "m")


def test_recovering_until_the_first_report_or_stale_after():
    clock = Clock()
    s = RegistryState(stale_after_s=20.0, clock=clock)
    assert s.recovering()  # new: the catalog may lack what the replicas know
    s.register_adapter("a", **SPEC)  # an API registration is not a replica's report
    assert s.recovering()
    clock.t += 1
    s.report_residency("r1", [], ["a"], {"b": SPEC})
    assert not s.recovering() and set(s.list_adapters()) == {"a", "b"}
    quiet = RegistryState(stale_after_s=20.0, clock=clock)
    clock.t += 20.5  # no replica reported within stale_after_s: an app with none
    assert not quiet.recovering()


def test_residency_reports_replace_and_version_tracks_content():
    clock = Clock()
    s = RegistryState(clock=clock)
    s.report_residency("r1", ["a"], ["a", "b"])
    v = s.version
    clock.t += 1
    s.report_residency("r1", ["a"], ["b", "a"])  # same content, new timestamp
    assert s.version == v
    assert s.snapshot()["residency"]["r1"] == {
        "slots": ["a"],
        "cpu": ["a", "b"],
        "last_report": 101.0,
    }
    s.report_residency("r1", [], ["b"])
    assert s.version == v + 1
    s.report_residency("r2", ["b"], ["b"])
    assert s.replicas_holding("b") == ["r1", "r2"]
    assert s.replicas_holding("a") == []


def test_catalog_from_reports_but_not_unregistered_names():
    s = RegistryState()
    s.register_adapter("gone", **SPEC)
    s.unregister_adapter("gone")
    s.report_residency("r1", [], ["a", "gone"], catalog={"a": SPEC, "gone": SPEC})
    assert set(s.list_adapters()) == {"a"}
    # A known entry is not overwritten by a replica's (possibly older) copy.
    s.report_residency("r2", [], [], catalog={"a": {**SPEC, "rank": 4}})
    assert s.list_adapters()["a"]["rank"] == 8
    s.register_adapter("gone", **SPEC)  # explicit register brings it back
    assert "gone" in s.list_adapters()


def test_prune_remove_and_expiry():
    clock = Clock()
    s = RegistryState(stale_after_s=30, clock=clock)
    for r in ("r1", "r2", "r3"):
        s.report_residency(r, [], ["a"])
    s.prune(["r1", "r2"])
    assert set(s.residency) == {"r1", "r2"}
    s.remove_replica("r2")
    s.remove_replica("missing")
    assert set(s.residency) == {"r1"}
    clock.t += 20
    s.report_residency("r4", [], [])
    clock.t += 15  # r1 last reported 35 s ago, r4 15 s ago
    snap = s.snapshot()
    assert set(snap["residency"]) == {"r4"}
    assert set(snap) == {"version", "adapters", "residency"}


class MemoryStore:
    """A fake durable store: keeps a deep copy of each saved record, counts calls, and fails
    saves while `fail` is set."""

    def __init__(self) -> None:
        self.saved: str | None = None  # the record as JSON: no aliasing with the state
        self.num_saves = 0
        self.num_loads = 0
        self.fail = False

    def load(self) -> dict | None:
        self.num_loads += 1
        return None if self.saved is None else json.loads(self.saved)

    def save(self, record: dict) -> None:
        if self.fail:
            raise OSError("disk full")
        self.num_saves += 1
        self.saved = json.dumps(record)


def test_unload_survives_restart_and_a_stale_report(tmp_path):
    path = tmp_path / "state" / "catalog.json"
    clock = Clock()
    s = RegistryState(clock=clock, store=FileStore(path))
    s.register_adapter("a1", **SPEC)
    s.register_adapter("a2", **SPEC2)
    clock.t = 150.0
    assert s.unregister_adapter("a2") is True
    on_disk = json.loads(path.read_text())  # the record, read independently of the store
    assert on_disk["adapters"] == {"a1": SPEC}
    assert on_disk["tombstones"] == {"a2": {"source": "/ad/a2", "unloaded_at": 150.0}}
    assert on_disk["version"] == 3

    restarted = RegistryState(clock=clock, store=FileStore(path))
    assert restarted.list_adapters() == {"a1": SPEC}  # the first call: complete, no a2
    assert restarted.recovering()  # residency is not in the record: no replica heard yet
    assert restarted.snapshot()["residency"] == {}
    # A replica whose catalog predates the unload reports it (and a built-in, b).
    stale = {"a1": SPEC, "a2": SPEC2, "b": {**SPEC, "source": "/ad/b"}}
    restarted.report_residency("r1", ["a1"], ["a1", "a2"], catalog=stale)
    assert not restarted.recovering()
    assert set(restarted.list_adapters()) == {"a1", "b"}
    assert restarted.snapshot()["residency"]["r1"]["cpu"] == ["a1", "a2"]  # residency as told

    again = RegistryState(clock=clock, store=FileStore(path))  # b was written when learned
    assert set(again.list_adapters()) == {"a1", "b"}
    again.report_residency("r2", [], [], catalog=stale)
    assert "a2" not in again.list_adapters()


def test_register_clears_the_tombstone_for_good():
    store = MemoryStore()
    s = RegistryState(store=store)
    s.register_adapter("a", **SPEC)
    s.unregister_adapter("a")
    s.register_adapter("a", **SPEC2)  # the load API, after an unload
    assert s.list_adapters() == {"a": SPEC2}
    assert json.loads(store.saved)["tombstones"] == {}

    restarted = RegistryState(store=store)
    restarted.report_residency("r1", [], ["a"], catalog={"a": SPEC})  # an older copy
    assert restarted.list_adapters() == {"a": SPEC2}
    restarted.unregister_adapter("a")
    restarted.report_residency("r1", [], ["a"], catalog={"a": SPEC})
    assert RegistryState(store=store).list_adapters() == {}


def test_only_catalog_changes_are_written():
    store = MemoryStore()
    s = RegistryState(store=store)
    assert store.num_loads == 1
    s.register_adapter("a", **SPEC)
    assert store.num_saves == 1
    s.register_adapter("a", **SPEC)  # same spec: nothing to write
    s.report_residency("r1", ["a"], ["a"], catalog={"a": SPEC2})  # known name: no change
    s.report_residency("r1", [], ["a"])
    s.prune([])
    s.snapshot()
    s.unregister_adapter("missing")
    assert (store.num_saves, store.num_loads) == (1, 1)
    # Two learned names from one report: one write.
    s.report_residency("r1", [], [], catalog={"b": SPEC, "c": SPEC, "bad": {**SPEC, "rank": 0}})
    assert store.num_saves == 2
    assert set(json.loads(store.saved)["adapters"]) == {"a", "b", "c"}


def test_a_failed_write_raises_and_changes_nothing():
    store = MemoryStore()
    s = RegistryState(store=store)
    s.register_adapter("a", **SPEC)
    before = store.saved
    store.fail = True
    with pytest.raises(OSError, match="disk full"):
        s.register_adapter("b", **SPEC)
    with pytest.raises(OSError, match="disk full"):
        s.unregister_adapter("a")
    assert s.list_adapters() == {"a": SPEC}  # memory agrees with what is durable
    with pytest.raises(OSError, match="disk full"):
        s.report_residency("r1", ["a"], ["a"], catalog={"c": SPEC})
    assert s.snapshot()["residency"]["r1"]["slots"] == ["a"]  # residency is still taken
    assert set(s.list_adapters()) == {"a"}
    assert store.saved == before
    store.fail = False
    s.unregister_adapter("a")
    assert RegistryState(store=store).list_adapters() == {}


def test_filestore_crash_before_the_replace_keeps_the_old_record(tmp_path, monkeypatch):
    path = tmp_path / "catalog.json"
    store = FileStore(path)
    old = {"format": 1, "version": 1, "adapters": {"a": SPEC}, "tombstones": {}}
    store.save(old)
    new = {**old, "version": 2, "adapters": {}, "tombstones": {"a": {"source": "/ad/a"}}}

    def crash(*args, **kwargs):
        raise OSError("crash")

    for step in ("fsync", "replace"):  # after writing the temp file; before renaming it
        with monkeypatch.context() as m:
            m.setattr(os, step, crash)
            with pytest.raises(OSError, match="crash"):
                store.save(new)
        assert json.loads(path.read_text()) == old
        assert store.load() == old
    assert os.listdir(tmp_path) == ["catalog.json"]  # no temp file left behind
    # A real crash leaves its temp file: it is not the record.
    (tmp_path / ".catalog.json.x1.tmp").write_text('{"format": 1, "vers')
    assert store.load() == old
    store.save(new)
    assert FileStore(path).load() == new


def test_filestore_missing_and_corrupt_records(tmp_path):
    assert FileStore(tmp_path / "none" / "catalog.json").load() is None  # a first start
    bad = tmp_path / "catalog.json"
    for text in ('{"format": 1, "version": 3, "adap', "[]", '{"format": 1, "version": 3}', ""):
        bad.write_text(text)
        with pytest.raises(CatalogStoreError, match=str(bad)):
            FileStore(bad).load()
        with pytest.raises(CatalogStoreError, match=str(bad)):
            RegistryState(store=FileStore(bad))  # the registry does not start empty
    folder = tmp_path / "a_folder"
    folder.mkdir()
    with pytest.raises(CatalogStoreError, match="cannot be read"):
        FileStore(folder).load()


# -- the actor on a local Ray cluster ----------------------------------------------------


def _drop_registry() -> None:
    """Kill the registry for good and delete its GCS record: the next test starts fresh."""
    import ray
    from ray.experimental import internal_kv

    from deployments.catalog_store import GcsKVStore
    from deployments.registry import REGISTRY_NAME, get_registry

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.kill(get_registry(), no_restart=True)
        except ValueError:  # the name is free
            break
        time.sleep(0.2)
    store = GcsKVStore(REGISTRY_NAME)
    internal_kv._internal_kv_del(store.key, namespace=store.namespace)


def _pid_gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _record(state_file: str | None) -> dict:
    if state_file is not None:
        return json.loads(open(state_file).read())
    from ray.experimental import internal_kv

    from deployments.registry import REGISTRY_NAME

    return json.loads(internal_kv._internal_kv_get(f"catalog/{REGISTRY_NAME}", namespace="raylora"))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["gcs", "file"])
def test_actor_restart_keeps_the_catalog_and_the_unload(ray_cluster, tmp_path, where):
    import ray

    from deployments.registry import get_or_create_registry, get_registry

    state_file = str(tmp_path / "catalog.json") if where == "file" else None
    try:
        h = get_or_create_registry(state_file=state_file)
        ray.get(h.register_adapter.remote("a1", **SPEC))
        ray.get(h.register_adapter.remote("a2", **SPEC2))
        assert ray.get(h.unregister_adapter.remote("a2")) is True
        # Durable once the call returned (the HTTP API answers only then).
        assert set(_record(state_file)["adapters"]) == {"a1"}
        assert set(_record(state_file)["tombstones"]) == {"a2"}
        assert get_or_create_registry(state_file=state_file)._actor_id == h._actor_id
        assert get_registry()._actor_id == h._actor_id
        old_pid = ray.get(h.__ray_call__.remote(lambda self: os.getpid()))

        t0 = time.monotonic()
        ray.kill(h, no_restart=False)
        while not _pid_gone(old_pid):  # so that the calls below reach the restarted actor
            assert time.monotonic() - t0 < 30, "the registry was not killed"
            time.sleep(0.01)
        # A replica with a stale catalog reports at once; max_task_retries=-1 makes the
        # calls wait for the restart.
        stale = {"a1": SPEC, "a2": SPEC2}
        ray.get(h.report_residency.remote("r1", ["a1"], ["a1", "a2"], stale), timeout=30)
        listed = ray.get(h.list_adapters.remote(), timeout=30)
        elapsed = time.monotonic() - t0
        assert ray.get(h.__ray_call__.remote(lambda self: os.getpid())) != old_pid
        assert listed == {"a1": SPEC}
        assert elapsed < 5.0, f"full catalog {elapsed:.1f} s after the kill"
        snap = ray.get(h.snapshot.remote())
        assert snap["adapters"] == {"a1": SPEC}
        assert snap["residency"]["r1"]["cpu"] == ["a1", "a2"]
        assert not ray.get(h.recovering.remote())

        # And the restarted actor's own changes are durable: load a2 again, restart again.
        ray.get(h.register_adapter.remote("a2", **SPEC2))
        ray.kill(h, no_restart=False)
        assert ray.get(h.list_adapters.remote(), timeout=30) == {"a1": SPEC, "a2": SPEC2}
        assert _record(state_file)["tombstones"] == {}
    finally:
        _drop_registry()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_actor_over_a_corrupt_file_dies_naming_it(ray_cluster, tmp_path):
    import ray

    from deployments.registry import get_or_create_registry

    bad = tmp_path / "catalog.json"
    bad.write_text('{"format": 1, "version": 3, "adap')
    with pytest.raises(ValueError, match="absolute"):
        get_or_create_registry(state_file="catalog.json")
    try:
        h = get_or_create_registry(state_file=str(bad))
        with pytest.raises(ray.exceptions.ActorDiedError, match=str(bad)):
            ray.get(h.list_adapters.remote(), timeout=60)  # no crash loop: it stays dead
    finally:
        _drop_registry()
