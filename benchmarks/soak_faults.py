"""The faults benchmarks/soak.py injects while its traffic runs, each timed from the moment
it strikes until the app has recovered from it.

- adapter churn: unload an adapter that traffic uses and load a new one, through the API;
- a replica killed (`ray.kill`, as an OOM kill or a lost node would end it): recovered when
  Serve runs the target number of LLMServer replicas again, one of them new;
- the AdapterRegistry killed (Ray restarts it): recovered when it lists the same catalog as
  before the kill; an adapter unloaded before the kill that comes back is *resurrected*, one
  loaded before it that is missing is *lost*.
The replica and registry faults need the Ray cluster the app runs on (`ray.init` done).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

POLL_S = 0.1


@dataclass
class FaultRecord:
    kind: str  # "replica" | "registry" | "churn"
    start: float  # time.monotonic() when it struck
    recovered: float | None = None  # when the app was whole again (None: it never was)
    detail: dict = field(default_factory=dict)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered is None else self.recovered - self.start

    def covers(self, start: float, end: float, grace_s: float) -> bool:
        """Whether a request that ran over [start, end] overlapped this fault's window."""
        until = (self.recovered if self.recovered is not None else float("inf")) + grace_s
        return start <= until and end >= self.start


def llm_server_replicas(app: str) -> set[str]:
    """The actor names of the app's LLMServer replicas (a replacement gets a new name)."""
    import ray

    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and "LLMServer" in a["name"] and f":{app}#" in a["name"]
    }


async def kill_replica(app: str, target: int, timeout_s: float = 120.0) -> FaultRecord:
    """Kill one LLMServer replica; recovered when a new replica answers requests and the
    deployment runs `target` replicas again (Serve's own status lags the kill by seconds,
    so the new replica must be seen answering)."""
    import ray
    from ray import serve

    before = llm_server_replicas(app)
    victim = sorted(before)[0]
    old_ids = {name.rsplit("#", 1)[-1] for name in before}
    handle = serve.get_deployment_handle("LLMServer", app_name=app)
    record = FaultRecord("replica", time.monotonic(), detail={"victim": victim})
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    while time.monotonic() - record.start < timeout_s:
        now = await asyncio.to_thread(llm_server_replicas, app)
        if len(now) == target and victim not in now:
            calls = (handle.stats.remote() for _ in range(2 * target))
            try:  # the dead replica may still be routed to for a moment: skip its errors
                answers = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
            except asyncio.TimeoutError:
                answers = []
            ids = {a["replica_id"] for a in answers if isinstance(a, dict)}
            if ids - old_ids:
                record.recovered = time.monotonic()
                record.detail["replacement"] = sorted(n for n in now if n not in before)
                break
        await asyncio.sleep(POLL_S)
    return record


async def kill_registry(unloaded: set[str], timeout_s: float = 60.0) -> FaultRecord:
    """Kill the registry; recovered once it answers with the catalog it had. Then watch it
    for a few report intervals: the replicas' reports must not resurrect an unload."""
    import ray

    from deployments.registry import get_registry

    handle = get_registry()
    catalog = set(await handle.list_adapters.remote())
    first = await handle.incarnation.remote()
    record = FaultRecord("registry", time.monotonic(), detail={"catalog_size": len(catalog)})
    ray.kill(handle, no_restart=False)
    listed: set[str] = set()
    while time.monotonic() - record.start < timeout_s:
        try:  # a call made while it restarts waits for the new process (max_task_retries)
            registry = get_registry()
            now = await asyncio.wait_for(registry.incarnation.remote(), 2.0)
            listed = set(await asyncio.wait_for(registry.list_adapters.remote(), 2.0))
        except Exception:
            await asyncio.sleep(POLL_S)
            continue
        if now != first and listed == catalog:
            record.recovered = time.monotonic()
            break
        await asyncio.sleep(POLL_S)
    await asyncio.sleep(3.0)  # a few replica reports (report_interval_s) later
    after = set(await get_registry().list_adapters.remote())
    record.detail["resurrected"] = sorted((after | listed) & unloaded)
    record.detail["lost"] = sorted(catalog - after)
    return record


async def churn(
    http: httpx.AsyncClient, live: list[str], new_name: str, new_path: str
) -> FaultRecord:
    """Unload a fairly warm live adapter (a quarter down the popularity order, so requests
    are in flight for it) and load `new_name` in its place; traffic picks from `live`, so
    requests already on their way to the old one meet a 404."""
    victim = live[len(live) // 4]
    record = FaultRecord("churn", time.monotonic(), detail={"unloaded": victim, "loaded": new_name})
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": victim})
    record.detail["unload_status"] = r.status_code
    live.remove(victim)
    r = await http.post(
        "/v1/load_lora_adapter", json={"lora_name": new_name, "lora_path": new_path}
    )
    record.detail["load_status"] = r.status_code
    if r.status_code == 200:
        live.append(new_name)
    record.recovered = time.monotonic()
    return record
