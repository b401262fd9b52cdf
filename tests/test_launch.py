"""Under torchrun as a cluster runs it: pre-emption (SIGTERM to the launcher) and a restart after a crash."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_slapo.checkpoints import checkpointing

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
       "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
       "--global-batch-size", "8", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
       "--lr", "1e-3", "--distributed-timeout-minutes", "1"]  # fmt: skip


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow  # a whole torchrun launch: CI's slow tier
def test_sigterm_to_torchrun_saves_and_exits(tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "out.log"
    cmd = torchrun("pretrain_gpt.py", *RUN, "--train-iters", "100000", "--exit-signal-handler", "--save", str(ck),
                   "--data-cache-path", str(tmp_path))  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while "iteration        3/" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # what SLURM sends at pre-emption; torchrun forwards it to the ranks
        proc.wait(timeout=120)
    text = log.read_text()
    assert "exiting program after receiving SIGTERM." in text, text[-3000:]
    saved = checkpointing.latest_iteration(str(ck))
    assert saved is not None and saved >= 3 and f"successfully saved checkpoint at iteration {saved:7d}" in text
    assert "Traceback" not in text.split("exiting program after receiving SIGTERM.")[0]  # no rank failed mid-step


@pytest.mark.slow  # a whole torchrun launch: CI's slow tier
def test_torchrun_restart_after_a_crash_resumes_from_the_last_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    cmd = torchrun("--max-restarts", "1", "tests/launch_worker.py", *RUN, "--train-iters", "5", "--save", str(ck),
                   "--load", str(ck), "--save-interval", "2", "--data-cache-path", str(tmp_path))  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env(CRASH_AT_ITERATION="3"), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "exitcode  : 17" in text or "exitcode: 17" in text, text[-4000:]  # the first round did crash
    assert f"loaded checkpoint {ck}/iter_0000002 at iteration 2" in text
    assert "iteration        5/       5" in text and checkpointing.latest_iteration(str(ck)) == 5
