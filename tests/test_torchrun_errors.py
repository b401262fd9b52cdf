"""Failures under torchrun: one line each, and the launcher's summary names the first one.

The in-process tests check the pieces (the error file torchrun reads, the one line for a peer's
death, rank 0's line answering the others'); the two slow ones run ``pretrain_gpt.py`` under
``torchrun --nproc_per_node 2`` as a user does: a bad flag, and a rank killed mid-training.
"""

import datetime
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_slapo.compat.distributed import collective_in
from megatron_slapo.errors import ConfigError
from megatron_slapo.training import error_report

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_LINE = "traceback : {}"  # how torchrun's summary shows a failed rank's message


@pytest.fixture
def plain_process(monkeypatch):
    """A process outside torchrun, whatever launched pytest: rank 0, no agent store, no error file."""
    for name in ("RANK", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)


def launcher_summary(error_file: Path, exitcode: int) -> str:
    """The failure summary torchrun prints for a rank that left ``error_file`` and exited with ``exitcode``."""
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("pretrain_gpt.py", {0: failure}).format_msg()


def test_an_input_error_is_the_launchers_root_cause(plain_process, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as exit_info, error_report.root_cause(), error_report.user_errors("prog.py"):
        raise ConfigError("--micro-batch-size 0 must be >= 1")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "prog.py: error: --micro-batch-size 0 must be >= 1\n"
    summary = launcher_summary(tmp_path / "error.json", 2)
    assert SUMMARY_LINE.format("prog.py: error: --micro-batch-size 0 must be >= 1") in summary, summary
    assert "Traceback" not in summary and "To enable traceback" not in summary


def test_a_bug_leaves_its_traceback_for_the_launcher(plain_process, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(KeyError), error_report.root_cause(), error_report.user_errors("prog.py"):
        {}["a bug"]  # noqa: B018
    assert "KeyError: 'a bug'" in launcher_summary(tmp_path / "error.json", 1)


def test_a_clean_exit_leaves_no_error_file(plain_process, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit), error_report.root_cause():
        sys.exit(0)
    assert not (tmp_path / "error.json").exists()


class _Ended(Exception):
    """Raised by the stand-in for ``exit_now``, which would end the test's process."""


def test_the_entry_point_ends_at_once_after_an_error_or_a_bug(plain_process, monkeypatch, capsys):
    """Not through the interpreter's shutdown, which tears gloo's threads down while they run
    ("terminate called without an active exception": SIGABRT, not the status)."""
    from megatron_slapo.training import loop

    statuses = []

    def exit_now(code):
        statuses.append(code)
        raise _Ended

    monkeypatch.setattr(error_report, "exit_now", exit_now)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--micro-batch-size", "0"])
    with pytest.raises(_Ended):
        loop.main("gpt")
    monkeypatch.setattr(loop, "pretrain", lambda task: {}["a bug"])
    with pytest.raises(_Ended):
        loop.main("gpt")
    assert statuses == [2, 1]
    err = capsys.readouterr().err
    assert "pretrain_gpt.py: error: --micro-batch-size 0 must be >= 1" in err and "KeyError: 'a bug'" in err


@pytest.mark.parametrize("code, status, said", [(2, 2, ""), ("prog.py: error: gone", 1, "prog.py: error: gone\n")])
def test_exit_now_keeps_what_was_printed_and_ends_with_the_status(code, status, said):
    script = ("import sys; from megatron_slapo.training.error_report import exit_now; print('out', end=''); "
              f"sys.stderr.write('err '); exit_now({code!r})")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout) == (status, "out") and done.stderr.endswith(f"err {said}"), done.stderr


def test_a_peers_death_is_one_line_and_exit_1(plain_process, capsys):
    with pytest.raises(SystemExit) as exit_info, error_report.lost_peers("prog.py"):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6054. GLHF!")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    # not in a torch.distributed function: where it was waited on (an asynchronous collective's wait)
    assert err == ("prog.py: error: rank 0 stopped: another rank died during a collective awaited in "
                   "test_a_peers_death_is_one_line_and_exit_1 (test_torchrun_errors.py) (Connection closed by "
                   "peer); its own output above, or the launcher's summary, says why\n")  # fmt: skip


def test_other_runtime_errors_are_not_taken_for_a_peers_death(plain_process):
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"), error_report.lost_peers("prog.py"):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_the_collective_is_read_from_the_traceback():
    with pytest.raises(TypeError) as in_torch:
        dist.all_reduce("not a tensor")  # fails inside torch.distributed's all_reduce, with a group or without
    assert collective_in(in_torch.tb) == "all_reduce"
    with pytest.raises(RuntimeError) as elsewhere:
        raise RuntimeError("elsewhere")
    assert collective_in(elsewhere.tb) is None


@pytest.mark.parametrize("rank_0_line, printed", [("prog.py: error: same", False), ("prog.py: error: other", True)])
def test_another_rank_prints_only_a_line_rank_0_did_not(rank_0_line, printed, monkeypatch, capsys):
    """Rank 0's n-th line, left in torchrun's store, answers rank 1's n-th error."""
    store = dist.HashStore()
    monkeypatch.setattr(error_report, "_reports", 0)
    monkeypatch.setattr(error_report, "_agent_store", lambda: store)
    monkeypatch.setattr(error_report, "_rank", lambda: 1)
    monkeypatch.setattr(error_report, "RANK_0_WAIT", datetime.timedelta(seconds=5))
    store.set("error_reported_1", rank_0_line)
    error_report.report("prog.py", "same")
    assert capsys.readouterr().err == ("prog.py: error: same\n" if printed else "")


def torchrun(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "pretrain_gpt.py",
        *args,
    ]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def no_traceback_of_ours(text: str) -> bool:
    """torchrun's own traceback (its ChildFailedError) is there; none runs through our code."""
    return re.search(r'File "[^"]*(megatron_slapo|pretrain_gpt\.py)', text) is None and "pair.cc" not in text


@pytest.mark.slow
def test_under_torchrun_a_bad_flag_is_one_line_and_the_root_cause(tmp_path):
    cmd = torchrun(
        "--micro-batch-size", "0", "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-path", str(tmp_path)
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert lines == ["pretrain_gpt.py: error: --micro-batch-size 0 must be >= 1"], text[-4000:]  # once, from one rank
    root_cause = text.split("Root Cause (first observed failure):")[-1]
    assert SUMMARY_LINE.format(lines[0]) in root_cause, text[-4000:]
    assert "To enable traceback" not in text and no_traceback_of_ours(text), text[-4000:]


TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
        "--lr", "1e-3"]  # fmt: skip


@pytest.mark.slow
def test_under_torchrun_a_corrupt_checkpoint_is_one_line_and_no_rank_aborts(tmp_path):
    """One such run in four ended with "terminate called without an active exception" (SIGABRT)
    on rank 0 after the line: the interpreter's shutdown tore gloo's threads down. Each rank now
    ends at once with the status (2), unless torchrun stopped it first (SIGTERM)."""
    from megatron_slapo.training.loop import pretrain

    ck = tmp_path / "ck"
    pretrain("gpt", [*TINY, "--train-iters", "1", "--save", str(ck), "--data-cache-path", str(tmp_path)])
    shard = ck / "iter_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(data)
    cmd = torchrun(*TINY, "--train-iters", "2", "--load", str(ck), "--data-cache-path", str(tmp_path))
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert len(lines) == 1 and f"checkpoint file {shard} is corrupt" in lines[0], text[-4000:]
    assert "terminate called" not in text and "SIGABRT" not in text, text[-4000:]
    statuses = re.findall(r"exitcode\s*: (-?\d+)", text)
    assert statuses and set(statuses) <= {"2", "-15"}, text[-4000:]


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_is_one_line_on_the_survivor(tmp_path):
    args = [*TINY, "--train-iters", "1000000", "--data-cache-path", str(tmp_path)]
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(torchrun(*args), cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + 240
        while "iteration        2/" not in log.read_text() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()[-4000:]
        (rank_1,) = [p for p in psutil.Process(proc.pid).children() if p.environ().get("RANK") == "1"]
        rank_1.send_signal(signal.SIGKILL)  # as the kernel's out-of-memory killer would
        proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode != 0
    lines = [line for line in text.splitlines() if line.startswith("pretrain_gpt.py: error: ")]
    assert len(lines) == 1, text[-4000:]
    match = re.fullmatch(r"pretrain_gpt\.py: error: rank 0 stopped: another rank died during (\w+|a collective "
                         r"awaited in \w+ \(\w+\.py\)) \(Connection (closed|reset) by peer\); its own output above, "
                         r"or the launcher's summary, says why", lines[0])  # fmt: skip
    # names torch.distributed's collective, or (an asynchronous one) the function that waited on it
    assert match and (hasattr(dist, match.group(1)) or match.group(1).startswith("a collective awaited")), lines[0]
    root_cause = text.split("Root Cause (first observed failure):")[-1]
    assert re.search(r"rank\s*: 1 .*Signal 9 \(SIGKILL\)", root_cause, re.S), text[-3000:]  # not the survivor
    assert no_traceback_of_ours(text), text[-4000:]
