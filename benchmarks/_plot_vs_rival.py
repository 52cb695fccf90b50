"""The plot of ``bench_vs_raytrain.py --plot`` and ``bench_vs_torchft.py --plot``: loss against wall
time and against instance-dollars.

Run with the benchmark-only virtualenv (matplotlib lives there, not in the project's dependencies);
its one argument is a JSON file of curves written by the benchmark.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    fig, (by_time, by_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, c in spec["curves"].items():
        style = "--" if "no preemptions" in label else "-"
        color = "tab:blue" if label.startswith("spotswarm") else "tab:red"
        by_time.plot(c["t"], c["loss"], style, color=color, label=label, linewidth=1.4)
        by_cost.plot(c["dollars"], c["loss"], style, color=color, label=label, linewidth=1.4)
    for ax, xlabel in ((by_time, "wall time (s)"), (by_cost, "instance-dollars ($)")):
        if spec.get("target") is not None:
            ax.axhline(spec["target"], color="grey", linewidth=0.8, linestyle=":", label="target loss")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    fig.suptitle(spec["title"])
    fig.tight_layout()
    fig.savefig(spec["out"], dpi=110)


if __name__ == "__main__":
    main()
