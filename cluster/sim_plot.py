"""Pareto plot of cluster/sim_sweep.py: slot loads against p99 TTFT for every policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.sim_sweep import Run


def plot_pareto(path: str, runs: list[Run], policies: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cluster.sim_sweep import PEER, TARGETS

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    # left: every run of every policy; loads over the run's floor so that points compare
    # (runs whose floor is under 1 load/1k, where every top adapter fits, are left out)
    floored = [r for r in runs if r.floor >= 1.0]
    for p in policies:
        xs = [r.results[p].slot_loads_per_1k / r.floor for r in floored]
        ys = [r.results[p].ttft_p99_ms for r in floored]
        left.scatter(xs, ys, s=18, alpha=0.7, label=p)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("slot loads / slot_load_floor")
    left.set_ylabel("p99 TTFT (ms)")
    left.set_title("every run with a floor >= 1 load/1k, every policy")
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    # right: affinity / peer per run, with the acceptance box
    judged = [r for r in runs if not r.overloaded()]
    over = [r for r in runs if r.overloaded()]
    for group, marker, label in ((judged, "o", "judged"), (over, "x", "overloaded (not judged)")):
        xs = [r.ratios()["slot"] for r in group]
        ys = [r.ratios()["p99"] for r in group]
        right.scatter(xs, ys, marker=marker, s=28, label=label)
        for r, x, y in zip(group, xs, ys, strict=True):
            right.annotate(str(r.point), (x, y), fontsize=6, alpha=0.7)
    right.axvline(TARGETS["slot"], color="k", lw=0.8, ls="--")
    right.axhline(TARGETS["p99"], color="k", lw=0.8, ls="--")
    right.set_xlabel(f"slot loads, affinity / {PEER}")
    right.set_ylabel(f"p99 TTFT, affinity / {PEER}")
    right.set_yscale("log")
    right.set_title("target: below and left of the dashed lines")
    right.grid(alpha=0.3, which="both")
    right.legend(fontsize=8)
    n = len({r.point for r in runs})
    fig.suptitle(
        f"routing sweep: {n} configurations x {len({r.seed for r in runs})} seeds, "
        f"{runs[0].cfg.num_requests} requests per run (python -m cluster.sim_sweep)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
