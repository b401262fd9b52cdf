"""A run stopped by hand: Ctrl-C is one line, ``pretrain_gpt.py: interrupted at iteration N; last
checkpoint: ...``, from rank 0, status 130 and no traceback of ours; with ``--exit-signal-handler
--exit-signal SIGINT`` the step finishes, the iteration is saved and the run resumes from it exactly.

A terminal's Ctrl-C sends SIGINT to its foreground process group: here the launched process is
the leader of a session of its own, and the test signals its group (``os.killpg``), as the
terminal would. Under torchrun only torchrun is in that group (its workers run in sessions of
their own); it forwards the signal to every worker, then ends with its own traceback
(``SignalException``), which is not ours.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.checkpoints import checkpointing
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.exit_conditions import ExitConditions
from megatron_slapo.training.loop import pretrain
from megatron_slapo.training.reporting import Reporter
from tests.test_torchrun_errors import no_traceback_of_ours
from tests.utils import tb_scalars

ROOT = Path(__file__).resolve().parents[1]
# the embedded default run (no data flags), tiny
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0", "--log-interval", "1",
        "--eval-iters", "0", "--distributed-timeout-minutes", "1"]  # fmt: skip
EXACT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0"]  # fmt: skip
LINE = re.compile(r"pretrain_gpt\.py: interrupted at iteration (\d+); (.*)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """The embedded corpus, prepared by the first run and shared by the others."""
    return str(tmp_path_factory.mktemp("cache"))


def _env() -> dict[str, str]:
    """This environment without a launcher's variables (pytest may itself run under torchrun)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT") and not k.startswith("TORCHELASTIC")}  # fmt: skip
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _command(ranks: int, *args: str) -> list[str]:
    script = str(ROOT / "pretrain_gpt.py")
    if ranks == 1:
        return [sys.executable, script, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script, *args]


def ctrl_c(ranks: int, args: list[str], cwd: Path, after: int = 1) -> tuple[int, str]:
    """Launch ``pretrain_gpt.py`` (under torchrun for ``ranks`` > 1), press Ctrl-C once iteration
    ``after`` is logged, and return its status and output."""
    log = cwd / f"ctrl-c-{ranks}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(ranks, *args), cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        deadline = time.time() + 240
        while f"iteration {after:8d}/" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    return proc.returncode, log.read_text()


def interrupted_line(text: str) -> re.Match:
    lines = [line for line in text.splitlines() if "interrupted at iteration" in line]
    assert len(lines) == 1, text[-4000:]  # one for the run, from rank 0
    match = LINE.fullmatch(lines[0])
    assert match, lines[0]
    assert no_traceback_of_ours(text) and "KeyboardInterrupt" not in text, text[-4000:]
    assert "terminate called" not in text, text[-4000:]
    return match


def test_ctrl_c_under_torchrun_is_one_line_from_rank_0(cache, tmp_path):
    status, text = ctrl_c(2, [*TINY, "--train-iters", "1000000", "--data-cache-path", cache], tmp_path)
    assert status != 0  # torchrun's own: it ends with a SignalException
    match = interrupted_line(text)
    assert int(match.group(1)) >= 1 and match.group(2) == "no checkpoint saved", match.group(0)
    assert "Received 2 death signal, shutting down workers" in text  # torchrun's word that it forwarded it


def test_ctrl_c_of_a_single_process_is_one_line_and_status_130(cache, tmp_path):
    ck = tmp_path / "ck"
    args = [*TINY, "--train-iters", "1000000", "--data-cache-path", cache, "--save", str(ck), "--save-interval", "1"]
    status, text = ctrl_c(1, args, tmp_path, after=2)  # iteration 1 is saved by then; the signal may stop a save
    assert status == 130, text[-4000:]
    match = interrupted_line(text)
    assert "Traceback" not in text
    saved = checkpointing.latest_iteration(str(ck))  # the last save committed
    assert saved and match.group(2) == f"last checkpoint: iteration {saved} in {ck}", match.group(0)


def test_the_line_names_the_iteration_and_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """In-process: a KeyboardInterrupt (what Python's SIGINT handler raises) after iteration 3's
    step, the checkpoint of iteration 2 committed."""
    step = Reporter.step

    def step_then_ctrl_c(self, iteration, *a, **k):
        step(self, iteration, *a, **k)
        if iteration == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Reporter, "step", step_then_ctrl_c)
    ck = tmp_path / "ck"
    with pytest.raises(SystemExit) as exit_:
        pretrain("gpt", [*MOCK, "--train-iters", "10", "--save", str(ck), "--save-interval", "2"])
    assert exit_.value.code == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"pretrain_gpt.py: interrupted at iteration 3; last checkpoint: iteration 2 in {ck}"]


def test_the_exit_signal_is_megatrons_flag_and_a_second_ctrl_c_stops_at_once():
    base = ["--mock-data", "--micro-batch-size", "2"]
    assert parse_args("gpt", base).exit_signal == "SIGTERM"  # SLURM's, Megatron's default
    assert parse_args("gpt", [*base, "--exit-signal", "SIGINT"]).exit_signal == "SIGINT"
    with pytest.raises(ConfigError, match="--exit-signal: invalid choice: 'SIGKILL'"):  # cannot be handled
        parse_args("gpt", [*base, "--exit-signal", "SIGKILL"])
    # Python's own handler before it, whatever this process was started with (a job started in the
    # background by a non-interactive shell ignores SIGINT, and Python keeps it ignored)
    started_with = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGINT)
    with ExitConditions(None, True, time.time(), signal.SIGINT) as exits:
        # raise_signal: delivered to this (the main) thread and handled before it returns; a kill() of
        # the process may land on another thread, its handler running some bytecodes later
        signal.raise_signal(signal.SIGINT)
        assert exits.received  # recorded: the step in flight goes on
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    restored = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, started_with)
    assert restored is before


@pytest.mark.slow  # three torchrun launches (~2 min)
def test_ctrl_c_with_the_exit_signal_handler_saves_that_iteration_and_resumes_exactly(cache, tmp_path):
    ck, tb = tmp_path / "ck", tmp_path / "tb"
    run = [*TINY, *EXACT, "--train-iters", "1000", "--data-cache-path", cache]  # one data order for all three
    status, text = ctrl_c(2, [*run, "--save", str(ck), "--exit-signal-handler", "--exit-signal", "SIGINT",
                              "--tensorboard-dir", str(tb / "interrupted")], tmp_path, after=2)  # fmt: skip
    match = interrupted_line(text)
    stopped = int(match.group(1))
    assert match.group(2) == f"last checkpoint: iteration {stopped} in {ck}", match.group(0)
    assert checkpointing.latest_iteration(str(ck)) == stopped, text[-4000:]
    assert "exiting program after receiving SIGINT." in text and f"saved checkpoint at iteration {stopped:7d}" in text
    end = ["--exit-interval", str(stopped + 3)]
    for name, extra in (("resumed", ["--load", str(ck)]), ("whole", [])):
        done = subprocess.run(_command(2, *run, *end, *extra, "--tensorboard-dir", str(tb / name)), cwd=tmp_path,
                              env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    whole, resumed = tb_scalars(str(tb / "whole"), "lm loss"), tb_scalars(str(tb / "resumed"), "lm loss")
    before = tb_scalars(str(tb / "interrupted"), "lm loss")
    assert sorted(resumed) == list(range(stopped + 1, stopped + 4)) and sorted(whole) == list(range(1, stopped + 4))
    for iteration in range(1, stopped + 4):
        losses = before if iteration <= stopped else resumed
        assert losses[iteration] == pytest.approx(whole[iteration], rel=1e-6, abs=0), iteration
