"""Sweep and plot for cluster/sim.py: slot loads and p99 TTFT against Zipf s and replica count."""

from __future__ import annotations

from dataclasses import replace

from cluster.sim import SimConfig, simulate


def sweep(cfg: SimConfig, policies: list[str], zipfs: list[float], replicas: list[int]):
    by_zipf = {p: [simulate(p, replace(cfg, zipf_s=s)) for s in zipfs] for p in policies}
    by_n = {p: [simulate(p, replace(cfg, num_replicas=n)) for n in replicas] for p in policies}
    return by_zipf, by_n


def plot(path: str, cfg: SimConfig, policies, zipfs, replicas, by_zipf, by_n) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        (axes[0][0], zipfs, by_zipf, "slot_loads_per_1k", "Zipf s", "adapter loads / 1k requests"),
        (axes[0][1], zipfs, by_zipf, "ttft_p99_ms", "Zipf s", "p99 TTFT (ms)"),
        (
            axes[1][0],
            replicas,
            by_n,
            "slot_loads_per_1k",
            "replicas",
            "adapter loads / 1k requests",
        ),
        (axes[1][1], replicas, by_n, "ttft_p99_ms", "replicas", "p99 TTFT (ms)"),
    ]
    for ax, xs, data, attr, xlabel, ylabel in panels:
        for p in policies:
            ax.plot(xs, [getattr(r, attr) for r in data[p]], marker="o", label=p)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if attr == "ttft_p99_ms":
            ax.set_yscale("log")
    axes[0][0].legend()
    fig.suptitle(
        f"{cfg.num_adapters} adapters, {cfg.max_loras} slots/replica, "
        f"{cfg.utilization:.0%} utilisation, {cfg.num_requests} requests per point "
        f"(top: {cfg.num_replicas} replicas; bottom: Zipf {cfg.zipf_s})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
