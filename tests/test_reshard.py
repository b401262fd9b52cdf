"""``--ckpt-format torch_dist``: one checkpoint resumes at another layout and on another engine with
the losses of the run that was not interrupted (fp32, gloo, dropout 0: within 1e-5 relative).

Each case is a real torchrun launch: the run that saves trains 14 iterations and saves at 6 (and
later); a copy of iteration 6 is resumed at the other layout to iteration 14, and its losses of
iterations 7-14 are compared with the saving run's. The vocabulary (the embedded corpus's 4096
tokens) pads to the same rows at every layout, so the two runs are the same model.

The README's suite keeps one such check without launches: one process's checkpoint resumed, in the
distributed suite's ranks, at TP2, ZeRO-3, FSDP and TP2 x DP2 with the distributed optimizer
(tests/distributed/test_engines.py).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.checkpoints.checkpoint_files import LATEST, iteration_dir
from tests.test_launch import ROOT, env
from tests.utils import tb_scalars

pytestmark = pytest.mark.slow  # a launch per layout: the tier CI runs after the README's test command

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--num-workers", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "14", "--log-interval", "1", "--eval-iters", "0",
        "--distributed-timeout-minutes", "2"]  # fmt: skip
GPT_TP = ["--schedule", "gpt_tp"]
TP2PP2 = [*GPT_TP, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
ZERO3 = ["--engine", "deepspeed", "--zero-stage", "3"]
SAVED_AT, LAST = 6, 14


def launch(ranks: int, argv: list[str], tb: Path, task: str = "gpt") -> dict[int, float]:
    """Train with ``ranks`` processes (one plain process for 1); the losses it logged."""
    script = f"pretrain_{task}.py"
    runner = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc_per_node={ranks}"]  # fmt: skip
    done = subprocess.run([*runner, script, *argv, "--tensorboard-dir", str(tb)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return tb_scalars(str(tb), "lm loss")


class Saved:
    """A run that trained to iteration 14 saving at 6: its losses, and copies of its iteration 6."""

    def __init__(self, root: Path, ranks: int, argv: list[str]) -> None:
        self.root, self.ck = root, root / "ck"
        self.losses = launch(
            ranks, [*BASE, *argv, "--save", str(self.ck), "--save-interval", str(SAVED_AT)], root / "tb"
        )

    def resumed(self, name: str, ranks: int, argv: list[str]) -> dict[int, float]:
        """Resume a copy of iteration 6 with ``ranks`` processes and ``argv``; its losses."""
        ck = self.root / name
        shutil.copytree(iteration_dir(str(self.ck), SAVED_AT), iteration_dir(str(ck), SAVED_AT))
        (ck / LATEST).write_text(str(SAVED_AT))
        losses = launch(ranks, [*BASE, *argv, "--load", str(ck), "--save", str(ck)], self.root / f"tb-{name}")
        assert sorted(losses) == list(range(SAVED_AT + 1, LAST + 1))
        return losses


def assert_same(resumed: dict[int, float], saved: Saved, rel: float = 1e-5) -> None:
    for iteration, loss in resumed.items():
        assert loss == pytest.approx(saved.losses[iteration], rel=rel, abs=0), (iteration, resumed, saved.losses)


@functools.cache
def _saved(tmp_root: str, name: str) -> Saved:
    runs = {"tp2pp2": (4, TP2PP2), "zero3": (2, ZERO3)}
    ranks, argv = runs[name]
    return Saved(Path(tmp_root) / name, ranks, argv)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    return lambda name: _saved(root, name)


@pytest.mark.parametrize(
    "name, ranks, argv",
    [
        ("one-process", 1, []),
        ("tp2-dp2-distributed-optimizer", 4, [*GPT_TP, "--tensor-model-parallel-size", "2",
                                              "--use-distributed-optimizer"]),
        ("pp2-virtual", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
        ("zero3-dp2", 2, ZERO3),
        ("fsdp-dp2", 2, ["--engine", "fsdp"]),
    ],
)  # fmt: skip
def test_a_tp2_pp2_checkpoint_resumes_at_another_layout(saved, name, ranks, argv) -> None:
    run = saved("tp2pp2")
    assert_same(run.resumed(name, ranks, argv), run)


def test_a_zero3_checkpoint_resumes_at_tp2_pp2(saved) -> None:
    run = saved("zero3")
    assert_same(run.resumed("tp2pp2", 4, TP2PP2), run)


FAMILIES = {
    # fused q|k|v and gate|up, grouped-query heads (2 key/value heads for 4 query heads)
    "llama": ["--model-type", "llama", "--schedule", "llama_tp", "--num-query-groups", "2"],
    # experts split by their features under TP
    "mixtral": ["--model-type", "mixtral", "--schedule", "auto", "--num-query-groups", "2", "--num-experts", "4"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_with_fused_and_grouped_weights_reshard_from_tp2_to_one_process(tmp_path, family) -> None:
    argv = [*FAMILIES[family], "--num-layers", "2"]
    run = Saved(tmp_path, 2, [*argv, "--tensor-model-parallel-size", "2"])
    assert_same(run.resumed("one-process", 1, argv), run)


def test_bf16_main_weights_and_moments_survive_a_tp2_to_tp1_reshard(tmp_path) -> None:
    argv = [*GPT_TP, "--bf16", "--num-layers", "2"]
    run = Saved(tmp_path, 2, [*argv, "--tensor-model-parallel-size", "2"])
    resumed = run.resumed("one-process", 1, argv)
    for iteration, loss in resumed.items():  # bf16's own rounding differs between layouts: within 2^-8
        assert abs(loss - run.losses[iteration]) <= 2**-8 * abs(run.losses[iteration]), (iteration, loss)
