"""Predicted against measured step time, layout by layout, on this machine.

    .venv/bin/python tools/calibrate.py --out calibration.json
    .venv/bin/python tools/bench_prediction.py --hardware calibration.json --out docs/benchmarks/DATE-prediction-cpu

Each layout is predicted by ``tools/explain.py``'s planning and the time model
(:mod:`megatron_slapo.estimates.time_model`) with the ``--hardware`` profile, then trained for
``--warmup`` + ``--steps`` steps by one ``torchrun`` of :mod:`megatron_slapo.tuning.trial`, launched as
``tools/autotune.py`` launches its trials (every rank one thread, as torchrun starts them; the
median of the slowest rank's step times). It prints
and writes (``prediction.json``, ``prediction.md`` under ``--out``) each layout's predicted and
measured seconds, their ratio, the predicted breakdown, and Spearman's rank correlation of the
two orders. The layouts (:data:`LAYOUTS`) cover every parallelism and recompute mode on GPT-2 and
Llama at sizes where a step is about a second; ``--layouts`` picks some by name.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from megatron_slapo.arguments.output_paths import check_output_file  # noqa: E402
from megatron_slapo.errors import ConfigError  # noqa: E402
from megatron_slapo.estimates import hardware  # noqa: E402
from megatron_slapo.training import error_report  # noqa: E402
from tools.autotune import trial_runner  # noqa: E402
from tools.explain import predicted  # noqa: E402

SIZES = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip
GPT = ["--schedule", "gpt_tp", *SIZES]
LLAMA = ["--model-type", "llama", "--schedule", "llama_tp", "--num-query-groups", "4", *SIZES]
MOE = ["--model-type", "qwen3_moe", "--schedule", "auto", "--num-experts", "4", "--moe-router-topk", "2", *SIZES]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
# name -> (ranks, trainer flags)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "gpt tp2": (2, [*GPT, *TP2]),
    "gpt tp2 sp": (2, [*GPT, *TP2, "--sequence-parallel"]),
    "gpt pp2 1f1b": (2, [*GPT, *PP2]),
    "gpt pp2 interleaved": (2, [*GPT, *PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    "gpt dp2": (2, GPT),
    "gpt zero3 dp2": (2, [*GPT, "--engine", "deepspeed", "--zero-stage", "3"]),
    "gpt fsdp2 dp2": (2, [*GPT, "--engine", "fsdp"]),
    "gpt tp2 full recompute": (
        2,
        [*GPT, *TP2, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    ),  # fmt: skip
    "gpt tp2 selective recompute": (2, [*GPT, *TP2, "--recompute-granularity", "selective"]),
    "gpt tp2 pp2": (4, [*GPT, *TP2, *PP2]),
    "llama tp2": (2, [*LLAMA, *TP2]),
    "llama dp2": (2, LLAMA),
    "llama cp2": (2, [*LLAMA, "--context-parallel-size", "2"]),
    "qwen3_moe ep2": (2, [*MOE, "--expert-model-parallel-size", "2"]),
}
QUICK = ("gpt tp2", "gpt pp2 1f1b", "gpt tp2 pp2")
TRIAL_TIMEOUT = 900  # seconds a layout's trial may take


def guessed(flags: list[str], world: int, profile: hardware.Hardware) -> dict:
    """The time model's step for ``flags`` on ``world`` ranks of this machine."""
    with contextlib.redirect_stdout(io.StringIO()):
        _, p = predicted("gpt", flags, world, world, profile)
    return {"seconds": p.step_time_s, "breakdown_s": p.breakdown_s, "verdict": p.verdict}


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among step times)."""

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        return [order.index(i) for i in range(len(values))]

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1)) if n > 1 else 1.0


def table(rows: list[dict], rho: float) -> str:
    lines = ["| layout | ranks | predicted s | measured s | predicted / measured | predicted breakdown |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['ranks']} | | | {r['error']} | |")
            continue
        parts = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r["breakdown_s"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['layout']} | {r['ranks']} | {r['predicted']:.3f} | {r['measured']:.3f} | "
                     f"{r['predicted'] / r['measured']:.2f} | {parts} |")  # fmt: skip
    lines.append(f"\nSpearman's rank correlation of predicted and measured: {rho:.3f}")
    return "\n".join(lines)


def run(names: list[str], profile: hardware.Hardware, warmup: int, steps: int) -> tuple[list[dict], float]:
    rows = []
    for name in names:
        world, flags = LAYOUTS[name]
        row: dict = {"layout": name, "ranks": world, "flags": flags}
        with tempfile.TemporaryDirectory() as scratch:
            cache = ["--data-cache-path", str(Path(scratch) / "cache")]
            guess = guessed([*flags, *cache], world, profile)
            real = trial_runner("gpt", [*flags, *cache], world, warmup, steps, TRIAL_TIMEOUT)([])
        if "error" in real:
            row["error"] = real["error"]
        else:
            row |= {"predicted": guess["seconds"], "measured": real["step_seconds"], "steps": real["steps"],
                    "breakdown_s": guess["breakdown_s"], "verdict": guess["verdict"]}  # fmt: skip
        print(f"{name}: {row.get('predicted', 0):.3f} s predicted, {row.get('measured', 0):.3f} s measured "
              f"{row.get('error', '')}", flush=True)  # fmt: skip
        rows.append(row)
    good = [r for r in rows if "error" not in r]
    return rows, spearman([r["predicted"] for r in good], [r["measured"] for r in good])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench_prediction.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", required=True, help="the profile of this machine (tools/calibrate.py's)")
    parser.add_argument("--layouts", help=f"comma-separated names (default: all): {', '.join(LAYOUTS)}")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="folder for prediction.json and prediction.md")
    a = parser.parse_args(argv)
    with error_report.user_errors("bench_prediction.py"):
        names = a.layouts.split(",") if a.layouts else list(QUICK if a.quick else LAYOUTS)
        unknown = [n for n in names if n not in LAYOUTS]
        if unknown:
            raise ConfigError(f"--layouts: unknown {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
        profile = hardware.load(a.hardware)
        if a.out:
            check_output_file("--out", str(Path(a.out) / "prediction.json"))
    rows, rho = run(names, profile, a.warmup, a.steps)
    text = table(rows, rho)
    print(text)
    errors = [abs(r["predicted"] / r["measured"] - 1) for r in rows if "error" not in r]
    if errors:
        print(f"median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "prediction.json").write_text(
            json.dumps({"hardware": profile.name, "rows": rows, "spearman": rho}, indent=1)
        )
        Path(a.out, "prediction.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
