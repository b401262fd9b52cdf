"""TensorBoard runs as one PNG: the loss and the throughput against iterations, a line per run.

    python tools/plot.py runs/gpt-tp2 runs/gpt-fused --out curves.png
    python tools/plot.py runs/* --tag "lm loss" --tag "lm loss validation" --out curves.png

Each argument is a run's ``--tensorboard-dir`` (its event files, a resumed run's several included),
labelled by its name (by its path where two runs share a name).
The default panels are the training loss (``lm loss``, or ``loss`` for image models) and the
throughput (``throughput(tps)``, tokens per second, or ``throughput(sps)``, samples).
"""

from __future__ import annotations

import argparse
import os

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

DEFAULT_PANELS = (("lm loss", "loss"), ("throughput(tps)", "throughput(sps)"))  # the first tag a run has


def read_scalars(run: str) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in one run's event files."""
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def panels(runs: dict[str, dict[str, dict[int, float]]], tags: list[str] | None) -> list[str]:
    """The tags to draw: those asked for, or for each default panel the first tag some run has."""
    present = {tag for scalars in runs.values() for tag in scalars}
    if tags:
        missing = [t for t in tags if t not in present]
        if missing:
            raise SystemExit(f"plot.py: no run has {missing}; the runs have: {', '.join(sorted(present))}")
        return tags
    chosen = [next((t for t in choices if t in present), None) for choices in DEFAULT_PANELS]
    if not any(chosen):
        raise SystemExit(f"plot.py: no loss or throughput in these runs; give --tag from: {', '.join(sorted(present))}")
    return [t for t in chosen if t]


def plot(runs: dict[str, dict[str, dict[int, float]]], tags: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(5.5 * len(tags), 4), squeeze=False)
    for ax, tag in zip(axes[0], tags, strict=True):
        for name, scalars in runs.items():
            if tag in scalars:
                steps = sorted(scalars[tag])
                ax.plot(steps, [scalars[tag][s] for s in steps], label=name)
        ax.set(title=tag, xlabel="iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(out, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="TensorBoard directories (--tensorboard-dir of each run)")
    p.add_argument("--tag", action="append", dest="tags", help="a scalar tag, one panel each; repeat it "
                   "(default: the loss and the throughput)")  # fmt: skip
    p.add_argument("--out", required=True, help="the PNG to write")
    a = p.parse_args(argv)
    names = [os.path.basename(os.path.normpath(run)) for run in a.runs]
    if len(set(names)) < len(names):  # runs/a/tb and runs/b/tb: their paths tell them apart
        names = [os.path.normpath(run) for run in a.runs]
    runs = {}
    for name, run in zip(names, a.runs, strict=True):
        scalars = read_scalars(run)
        if not scalars:
            raise SystemExit(f"plot.py: {run} holds no TensorBoard scalars")
        runs[name] = scalars
    tags = panels(runs, a.tags)
    plot(runs, tags, a.out)
    print(f"{a.out}: {', '.join(tags)} for {len(runs)} run(s)")


if __name__ == "__main__":
    main()
