"""The tuner on a cluster not in hand: ``tools/autotune.py --hardware ... --predict-only`` ranks
every layout by the time model and prints the best as commands for that cluster; the ranking
itself (tuning/prediction.py) skips dearer recomputation where a cheaper one fits."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.errors import ConfigError
from megatron_slapo.tuning.prediction import rank_points
from megatron_slapo.tuning.space import Space

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--num-workers", "0"]  # fmt: skip


class _Prediction:
    def __init__(self, seconds: float) -> None:
        self.step_time_s = seconds


def test_ranking_plans_recompute_only_where_the_cheaper_does_not_fit():
    space = Space()
    space.symbol("tp", [1, 2])
    space.symbol("recompute", ["none", "selective", "full"])
    planned = []

    def plan(flags):
        planned.append(flags)
        tp, recompute = int(flags[0]), flags[1]
        if tp == 1 and recompute == "full":
            raise ConfigError("refused")
        peak = {"none": 30, "selective": 20, "full": 10}[recompute] // tp
        return peak, 0, _Prediction(tp + {"none": 0, "selective": 0.1, "full": 0.5}[recompute])

    ranked = rank_points(space, lambda p: [str(p["tp"]), p["recompute"]], plan, budget=15)
    assert planned == [["1", "none"], ["1", "selective"], ["1", "full"], ["2", "none"]]
    assert [(p.point["tp"], p.point["recompute"]) for p in ranked if p.prediction] == [(2, "none")]
    assert [p.why for p in ranked if not p.prediction] == [
        "over memory: rank 0 needs 0.0 GiB",
        "over memory: rank 0 needs 0.0 GiB",
        "refused: refused",
    ]


def _autotune(*flags):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "tools/autotune.py", *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_predict_only_prints_the_best_layouts_as_commands_for_the_cluster(tmp_path):
    done = _autotune("--hardware", "h100-sxm", "--nodes", "2", "--gpus-per-node", "2", "--predict-only",
                     "--micro-batch-sizes", "1,2", "--zero", "0,1", "--recompute", "none,full", "--",
                     *TINY, "--data-cache-path", str(tmp_path / "cache"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("> predicted ") and "on h100-sxm (2 node(s) x 2)" in line for line in lines)
    commands = [line for line in lines if "pretrain_gpt.py" in line]
    assert 1 <= len(commands) <= 5
    assert all("--nnodes 2 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 --nproc_per_node=2" in c
               for c in commands)  # fmt: skip
    ranked = [line for line in lines if line.startswith("> 1. ") or line.startswith("> 2. ")]
    assert ranked and "s per step" in ranked[0] and "tokens/s per device" in ranked[0]


@pytest.mark.parametrize(
    "flags, message",
    [(["--predict-only"], "--predict-only: give --hardware too (what to predict on)"),
     (["--hardware", "h100-sxm"], "--hardware: give --predict-only (rank by prediction) or --trials K"),
     (["--hardware", "h100-sxm", "--trials", "2", "--nproc-per-node", "2"],
      "--trials runs here on --nproc-per-node 2 ranks")],
)  # fmt: skip
def test_bad_hardware_flags_are_one_line(tmp_path, flags, message):
    done = _autotune(*flags, "--", *TINY, "--data-cache-path", str(tmp_path / "cache"))
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith(f"autotune.py: error: {message}"), err
