"""Does FP8 learn like bf16? The quick-start run twice, in bf16 and with ``--fp8-format hybrid``.

    .venv/bin/python tools/fp8_convergence.py --out docs/benchmarks/<date>-fp8-convergence-cpu

Both runs are the README's quick start (``torchrun --nproc_per_node 2 pretrain_gpt.py --schedule
gpt_tp --tensor-model-parallel-size 2`` on the embedded corpus, its defaults) with ``--bf16``,
for ``--train-iters`` iterations (300), validated every 50; one of them adds ``--fp8-format
hybrid`` (``--fp8-recipe``: tensorwise). Without FP8 hardware the FP8 products are emulated: the
same casts and scales, multiplied in fp32, so the losses are those a GPU would give (its speed is
not: ``tools/bench_fp8.py``). OUT receives each run's TensorBoard events and log,
``training-loss.png`` and ``validation-loss.png``, and ``summary.json`` and ``summary.md``: each
run's last validation loss (the end of training's) and FP8's relative to bf16's, with the date,
the machine and the commands.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import torch  # noqa: E402

from tools.plot import plot, read_scalars  # noqa: E402

QUICK_START = ["--schedule", "gpt_tp", "--tensor-model-parallel-size", "2", "--bf16", "--eval-interval", "50"]
RUNS = {"bf16": [], "fp8-hybrid": ["--fp8-format", "hybrid"]}


def train(name: str, flags: list[str], out: Path, iters: int, recipe: str) -> None:
    """One run of the quick start under torchrun, its TensorBoard events in ``out/name``."""
    extra = ["--fp8-recipe", recipe] if flags else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
           *QUICK_START, *flags, *extra, "--train-iters", str(iters), "--tensorboard-dir", str(out / name)]  # fmt: skip
    print(f"== {' '.join(cmd[2:])}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(f"fp8_convergence.py: the {name} run failed (exit status {done.returncode}); see {out / name}.log")


def summarize(out: Path) -> dict:
    """Each run's validation losses, its last one, and FP8's last relative to bf16's."""
    scalars = {name: read_scalars(str(out / name)) for name in RUNS}
    validation = {name: runs["lm loss validation"] for name, runs in scalars.items()}
    last = {name: values[max(values)] for name, values in validation.items()}
    summary = {"validation": {name: {str(k): v for k, v in values.items()} for name, values in validation.items()},
               "last_validation": last, "fp8_relative_to_bf16": last["fp8-hybrid"] / last["bf16"] - 1}  # fmt: skip
    plot(scalars, ["lm loss"], str(out / "training-loss.png"), smoothing=0.6)
    plot(scalars, ["lm loss validation"], str(out / "validation-loss.png"), smoothing=0)  # six points: as they are
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fp8_convergence.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="where the runs, curves.png and summary.{json,md} go")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--fp8-recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    p.add_argument("--plot-only", action="store_true", help="summarize and draw the runs already in --out")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, flags in RUNS.items():
        if not args.plot_only:
            train(name, flags, out, args.train_iters, args.fp8_recipe)
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    last = summary["last_validation"]
    device = (
        torch.cuda.get_device_name() if torch.cuda.is_available() else f"a CPU ({os.cpu_count()} cores; FP8 emulated)"
    )
    commands = [
        f"    torchrun --nproc_per_node 2 pretrain_gpt.py {' '.join(QUICK_START + flags)} --train-iters "
        f"{args.train_iters}" + (f" --fp8-recipe {args.fp8_recipe}" if flags else "")
        for flags in RUNS.values()
    ]
    lines = [f"{time.strftime('%Y-%m-%d')}, {device}: the quick-start model, {args.train_iters} iterations, TP2 "
             f"over 2 processes", "", *commands, "", "| run | last validation loss |", "|---|---|",
             *(f"| {name} | {loss:.4f} |" for name, loss in last.items()),
             "", f"FP8 relative to bf16: {summary['fp8_relative_to_bf16']:+.2%}"]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
