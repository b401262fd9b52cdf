"""``--async-save``: a run killed (SIGKILL to every rank) while a save is in flight resumes from the
checkpoint before, with the losses of the run that was killed; the save in flight never becomes
``latest``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from megatron_slapo.checkpoints import checkpointing
from tests.test_launch import ROOT, RUN, env, torchrun
from tests.utils import tb_scalars

EXACT = ["--hidden-dropout", "0", "--attention-dropout", "0", "--schedule", "gpt_tp", "--tensor-model-parallel-size",
         "2", "--train-iters", "10", "--engine", "ddp"]  # fmt: skip


@pytest.mark.slow  # two torchrun launches (~40 s)
def test_a_run_killed_during_an_async_save_resumes_from_the_checkpoint_before(tmp_path):
    ck, log, tb = tmp_path / "ck", tmp_path / "out.log", tmp_path / "tb"
    cmd = torchrun("tests/launch_worker.py", *RUN, *EXACT, "--save", str(ck), "--save-interval", "3", "--async-save",
                   "--tensorboard-dir", str(tb / "killed"), "--data-cache-path", str(tmp_path))  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(HOLD_SAVE_AT="6"), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        held = [ck / f"HOLD_SAVE_AT.rank{r}" for r in (0, 1)]
        while not (all(p.exists() for p in held) and "iteration        8/" in log.read_text()):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        for pid in [int(p.read_text()) for p in held] + [proc.pid]:  # every rank, then torchrun, mid-save
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert (ck / "iter_0000006.tmp").is_dir() and not (ck / "iter_0000006").exists()
    assert checkpointing.latest_iteration(str(ck)) == 3  # the save in flight never became latest
    # the killed run's losses from its log lines (printed and flushed each step; its TensorBoard
    # events were still queued when it was killed)
    logged = re.findall(r"iteration +(\d+)/ +\d+ \|.*?\| lm loss: ([0-9.E+-]+)", log.read_text())
    killed = {int(i): float(v) for i, v in logged}
    resumed = subprocess.run(
        torchrun("pretrain_gpt.py", *RUN, *EXACT, "--load", str(ck), "--save", str(tmp_path / "again"),
                 "--tensorboard-dir", str(tb / "resumed"), "--data-cache-path", str(tmp_path)),
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "loaded checkpoint" in resumed.stdout and "at iteration 3" in resumed.stdout
    again = tb_scalars(str(tb / "resumed"), "lm loss")
    assert min(again) == 4 and max(again) == 10
    for iteration in range(4, 8):  # the killed run's losses, step for step (as logged: 7 digits)
        assert again[iteration] == pytest.approx(killed[iteration], rel=1e-6, abs=0), iteration
