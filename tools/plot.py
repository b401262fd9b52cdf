"""TensorBoard runs as one PNG: the loss and the throughput against iterations, a line per run.

    .venv/bin/python tools/plot.py runs --out curves.png
    .venv/bin/python tools/plot.py runs/gpt-tp2 runs/gpt-fused --smooth 0.9 --out curves.png
    .venv/bin/python tools/plot.py runs/* --tag "lm loss" --tag "lm loss validation" --out curves.png

Each argument is a run's ``--tensorboard-dir`` (its event files, a resumed run's several included)
or a directory of runs (``runs``): every directory at or under it that holds event files is a run.
A run is labelled by its name: its directory's, or for a default directory
(``runs/<what ran>/<time>``, see ``--tensorboard-dir``) what ran; with the time, or the whole
path, where two runs would share a label.
The default panels are the training loss (``lm loss``, or ``loss`` for image models) and the
throughput (``throughput(tps)``, tokens per second, or ``throughput(sps)``, samples). Each line
is smoothed as TensorBoard smooths (``--smooth``, an exponential moving average), with the raw
points drawn faint behind it.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import math
import os
import re
import sys
from collections import Counter
from typing import TYPE_CHECKING

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DEFAULT_PANELS = (("lm loss", "loss"), ("throughput(tps)", "throughput(sps)"))  # the first tag a run has
DEFAULT_SMOOTHING = 0.6  # TensorBoard's
TIME = re.compile(r"\d{8}-\d{6}")  # a default run directory's last part (training/reporting.py)


def read_scalars(run: str) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in one run's event files."""
    acc = EventAccumulator(run, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def find_runs(paths: list[str]) -> list[str]:
    """The runs the arguments name: every directory at or under each that holds event files."""
    runs = []
    for path in paths:
        if not os.path.isdir(path):
            raise SystemExit(
                f"plot.py: {path} is not a directory; give runs' --tensorboard-dir (or a directory of them)"
            )
        found = sorted(
            top for top, _, files in os.walk(path) if any(f.startswith("events.out.tfevents") for f in files)
        )
        if not found:
            raise SystemExit(f"plot.py: {path} holds no TensorBoard event files")
        runs += found
    return runs


def labels(runs: list[str]) -> list[str]:
    """Each run's label: its name (the parent's for a ``<name>/<time>`` default directory), then
    ``<name>/<time>``, then its whole path, as far as needed to tell it from the others."""

    def forms(run: str) -> tuple[str, str, str]:
        path = os.path.normpath(run)
        base, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
        if TIME.fullmatch(base) and parent:
            return parent, f"{parent}/{base}", path
        return base, base, path

    chosen = [forms(run)[0] for run in runs]
    for level in (1, 2):
        shared = Counter(chosen)
        chosen = [forms(run)[level] if shared[label] > 1 else label for run, label in zip(runs, chosen, strict=True)]
    return chosen


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average of weight ``weight`` (0: none),
    debiased (divided by ``1 - weight**n`` after n points, so that the line starts at the data
    rather than at zero); a non-finite value is drawn as it is and left out of the average."""
    smoothed, last, n = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            smoothed.append(value)
            continue
        last = weight * last + (1 - weight) * value
        n += 1
        smoothed.append(last / (1 - weight**n))
    return smoothed


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


def plot(runs: dict[str, dict[str, dict[int, float]]], tags: list[str], out: str,
         smoothing: float = DEFAULT_SMOOTHING) -> Figure:  # fmt: skip
    """Draw a panel per tag, a line per run (smoothed, its raw points faint behind); save to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tags), figsize=(5.5 * len(tags), 4), squeeze=False)
    for ax, tag in zip(axes[0], tags, strict=True):
        for i, (name, scalars) in enumerate(runs.items()):
            if tag in scalars:
                steps = sorted(scalars[tag])
                values = [scalars[tag][s] for s in steps]
                if smoothing:
                    ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=0.8)
                ax.plot(steps, smooth(values, smoothing), color=f"C{i}", label=name)
        ax.set(title=f"{tag} (smoothed {smoothing:g})" if smoothing else tag, xlabel="iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    return fig


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="plot.py", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="TensorBoard directories (--tensorboard-dir of each run), or "
                   "directories of them (runs)")  # fmt: skip
    p.add_argument("--tag", action="append", dest="tags", help="a scalar tag, one panel each; repeat it "
                   "(default: the loss and the throughput)")  # fmt: skip
    p.add_argument("--smooth", type=float, default=DEFAULT_SMOOTHING, metavar="W",
                   help="TensorBoard's smoothing weight, 0 (none) to below 1 (default %(default)s); the raw "
                   "points are drawn faint behind")  # fmt: skip
    p.add_argument("--out", required=True, help="the PNG to write")
    a = p.parse_args(argv)
    if not 0 <= a.smooth < 1:
        p.error(f"--smooth {a.smooth:g}: give a weight from 0 (no smoothing) to below 1")
    found = find_runs(a.runs)
    runs, empty = {}, []
    for name, run in zip(labels(found), found, strict=True):
        scalars = read_scalars(run)
        if scalars:
            runs[name] = scalars
        else:  # a run stopped before its first logged iteration: nothing to draw
            empty.append(run)
    if not runs:
        raise SystemExit(f"plot.py: {', '.join(empty)}: no TensorBoard scalars to plot")
    if empty:
        print(f"plot.py: left out (no scalars yet): {', '.join(empty)}", file=sys.stderr)
    tags = panels(runs, a.tags)
    plot(runs, tags, a.out, a.smooth)
    print(f"{a.out}: {', '.join(tags)} for {len(runs)} run(s)")


if __name__ == "__main__":
    main()
