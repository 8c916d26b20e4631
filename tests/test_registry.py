"""RegistryState without Ray; one Ray test: the actor restarts and is rebuilt from reports."""

import time

import pytest

from deployments.registry import RegistryState

SPEC = {"source": "/ad/a", "rank": 8, "target_modules": ["q_proj", "v_proj"], "base_model": "m"}


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_actor_restarts_and_is_rebuilt_from_reports():
    import ray

    from deployments.registry import REGISTRY_NAME, REGISTRY_NAMESPACE, get_or_create_registry

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        h = get_or_create_registry()
        ray.get(h.register_adapter.remote("a", **SPEC))
        ray.get(h.report_residency.remote("r1", ["a"], ["a"], {"a": SPEC}))
        assert ray.get(h.snapshot.remote())["residency"]["r1"]["slots"] == ["a"]
        again = get_or_create_registry()  # get_if_exists: the same actor
        assert again._actor_id == h._actor_id
        assert ray.get_actor(REGISTRY_NAME, namespace=REGISTRY_NAMESPACE)._actor_id == h._actor_id

        ray.kill(h, no_restart=False)
        deadline = time.time() + 60
        while True:  # kill is asynchronous; max_task_retries=-1 makes calls wait for the restart
            try:
                snap = ray.get(h.snapshot.remote(), timeout=30)
                if not snap["residency"]:
                    break
            except ray.exceptions.RayActorError:
                pass
            assert time.time() < deadline, "registry did not restart"
            time.sleep(0.2)
        assert snap["adapters"] == {}  # state was in memory only
        ray.get(h.report_residency.remote("r1", ["a"], ["a"], {"a": SPEC}))
        snap = ray.get(h.snapshot.remote())
        assert snap["adapters"] == {"a": SPEC}
        assert snap["residency"]["r1"]["slots"] == ["a"]
        ray.kill(h, no_restart=True)
    finally:
        ray.shutdown()
