"""examples/: the single-node and SLURM scripts. They parse, their dry runs print each node's torchrun
command, and two "nodes" on this machine, launched as the SLURM scripts launch them (``srun`` is a
stand-in that starts the per-node task twice here), train with the losses of one node of two ranks,
through a stop, a requeue and a resume."""

import glob
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.data import embedded
from tests.utils import tb_scalars
from tools.launch_node import expand_hostlist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.s*"), recursive=True))  # .sh, .sbatch
# What srun does for the sbatch scripts: one task per node (here: all on this machine), SLURM_NODEID each
# (Its options must be one word each, --name=value, as srun reads an optional value only so.) It
# exits with SRUN_STATUS when set: 143, as torchrun does after a SIGTERM, though its workers saved.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do echo "$1" >> "$SRUN_LOG"; shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit ${SRUN_STATUS:-$status}
"""
FAKE_SCONTROL = '#!/bin/bash\necho "$@" >> "$SCONTROL_LOG"\n'


READ_BY_THE_SCRIPTS = {"GPUS", "TP", "GPUS_PER_NODE", "CHECKPOINT_DIR", "TENSORBOARD_DIR", "EXIT_MARGIN_MIN",
                      "MAX_REQUEUES", "DATA", "VOCAB", "MERGES", "CUDA_VISIBLE_DEVICES"}  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MASTER_")) and k not in READ_BY_THE_SCRIPTS}  # fmt: skip
    return {**base, "PYTHON": sys.executable, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **extra}


def test_every_script_parses():
    assert len(SCRIPTS) >= 5, SCRIPTS  # single_node.sh, common.sh, one sbatch each for GPT, BERT, T5
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", script], check=True)


def test_host_lists_expand_as_slurm_does():
    assert expand_hostlist("gpu[01-03,10],login") == ["gpu01", "gpu02", "gpu03", "gpu10", "login"]
    assert expand_hostlist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert expand_hostlist("node[098-101]") == ["node098", "node099", "node100", "node101"]


@pytest.mark.parametrize("task", ["gpt", "bert", "t5"])
def test_dry_run_prints_each_nodes_torchrun_command(task):
    env = _env(SLURM_JOB_NODELIST="gpu[07-09]", SLURM_JOB_ID="4321")
    proc = subprocess.run(["bash", f"examples/slurm/pretrain_{task}.sbatch", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout + proc.stderr
    for rank, line in enumerate(lines):
        host, command = line.split(" ", 1)
        argv = shlex.split(command)
        entry = argv.index(f"pretrain_{task}.py")
        assert host == f"[gpu0{7 + rank}]" and os.path.basename(argv[0]) == "torchrun"
        assert argv[1:entry] == ["--nnodes", "3", "--node_rank", str(rank), "--nproc_per_node", "8",
                                 "--master_addr", "gpu07", "--master_port", str(29500 + 321)]  # fmt: skip
        args = parse_args(task, argv[entry + 1 :])  # every flag is the trainer's
        assert args.save == args.load and args.save.startswith("checkpoints/")
        assert args.tensorboard_dir == f"runs/{os.path.basename(args.save)}-4321"
        assert args.exit_signal_handler and args.exit_duration_in_mins == 230


def _bash(snippet: str, **env: str) -> str:
    """``snippet`` run with examples/slurm/common.sh's functions."""
    script = f"set -euo pipefail; source examples/slurm/common.sh; {snippet}"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(PATH=os.environ["PATH"], **env),
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def test_the_job_reads_the_trainers_last_flags_and_the_time_left():
    assert _bash("last_value --train-iters 0 --train-iters 5 --lr 1 --train-iters=9") == "9"
    assert _bash("last_value --save ckpt --lr 1") == "ckpt"
    end = str(int(time.time()) + 3600 + 30)
    assert _bash("minutes_left", SLURM_JOB_END_TIME=end, TIME_LIMIT_MIN="240") == "60"
    assert _bash("squeue() { echo 1-02:03:04; }; minutes_left", SLURM_JOB_ID="5", TIME_LIMIT_MIN="240") == "1563"
    assert _bash("squeue() { echo UNLIMITED; }; minutes_left", SLURM_JOB_ID="5", TIME_LIMIT_MIN="240") == "240"


def test_a_flag_after_the_scripts_name_replaces_its_value():
    """Trainer flags given after the script's name replace the script's own values of those flags
    where they stood, a --data-path blend whole and --flag=value alike, rather than following them
    on the command line (where the dry run showed both); a flag the script lacks goes at the end."""
    env = _env(SLURM_JOB_NODELIST="gpu1", SLURM_JOB_ID="1")
    overrides = ["--train-iters", "100", "--data-path", "0.3", "A", "0.7", "B", "--lr=0.001", "--save", "mine",
                 "--seed", "7"]  # fmt: skip
    proc = subprocess.run(["bash", "examples/slurm/pretrain_gpt.sbatch", "--dry-run", *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    argv = shlex.split(proc.stdout.splitlines()[0].split(" ", 1)[1])
    trainer = argv[argv.index("pretrain_gpt.py") + 1 :]
    flags = [word.split("=")[0] for word in trainer if word.startswith("--")]
    assert len(flags) == len(set(flags)), trainer
    at = trainer.index("--data-path")
    assert trainer[at : at + 6] == ["--data-path", "0.3", "A", "0.7", "B", "--tokenizer-type"]
    assert trainer[trainer.index("--global-batch-size") + 2 : trainer.index("--lr=0.001") + 1] == [
        "--train-iters", "100", "--lr=0.001"
    ]  # fmt: skip
    assert trainer[-2:] == ["--seed", "7"]
    args = parse_args("gpt", trainer)
    assert (args.train_iters, args.lr, args.save, args.seed) == (100, 0.001, "mine", 7)
    assert args.data_path == ["0.3", "A", "0.7", "B"] and args.load == "checkpoints/gpt2-345m"
    words = "one_value_per_flag lead --a 1 --b --a=2 --c x y --b | tr '\\0' ' '"
    assert _bash(words) == "lead --a=2 --b --c x y"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_loopback_train_as_one_node_through_a_requeue(tmp_path):
    data = embedded.prepare("gpt", os.path.join(os.path.expanduser("~"), ".cache", "megatron_slapo"))
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0"]  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = _env(SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="77",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GPUS_PER_NODE="1", SRUN_STATUS="143",
                 DATA=data.prefix, VOCAB=data.vocab_file, MERGES=data.merge_file,
                 CHECKPOINT_DIR=str(tmp_path / "ckpt"), TENSORBOARD_DIR=str(tmp_path / "tb-nodes"),
                 SCONTROL_LOG=str(tmp_path / "scontrol.log"), SRUN_LOG=str(tmp_path / "srun.log"),
                 PATH=f"{bin_dir}:{os.environ['PATH']}")  # fmt: skip
    sbatch = ["bash", "examples/slurm/pretrain_gpt.sbatch", *tiny, "--train-iters", "6", "--exit-interval", "3"]
    for submission in ("first", "requeued"):  # SLURM runs the same script again after a requeue
        proc = subprocess.run(sbatch, cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{submission}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        slurm["MASTER_PORT"], slurm["SRUN_STATUS"] = str(_free_port()), ""  # the second ends as it ends
    # requeued after the stop at 3 (srun failing as after a SIGTERM), not after reaching 6
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
    assert (tmp_path / "srun.log").read_text().split() == ["--ntasks-per-node=1", "--kill-on-bad-exit=1"] * 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"

    dry = subprocess.run([*sbatch, "--dry-run"], cwd=ROOT, env=slurm, capture_output=True, text=True, check=True)
    node_args = shlex.split(dry.stdout.splitlines()[0].split(" ", 1)[1])
    trainer = node_args[node_args.index("pretrain_gpt.py") + 1 :]
    one_node = [a for a in trainer if a not in ("--exit-interval", "3")]  # the same run, uninterrupted
    one_node += ["--save", str(tmp_path / "ckpt-one"), "--load", str(tmp_path / "ckpt-one"),
                 "--tensorboard-dir", str(tmp_path / "tb-one")]  # fmt: skip
    proc = subprocess.run(["bash", "examples/single_node.sh", *one_node], cwd=ROOT, env=_env(GPUS="2"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    nodes, one = tb_scalars(str(tmp_path / "tb-nodes"), "lm loss"), tb_scalars(str(tmp_path / "tb-one"), "lm loss")
    assert sorted(nodes) == sorted(one) == list(range(1, 7))
    for step in one:
        assert abs(nodes[step] - one[step]) <= 1e-6, (step, nodes[step], one[step])


FAKE_PROGRESS_SRUN = """#!/bin/bash
mkdir -p "$CKPT" && echo "$REACHED" > "$CKPT/latest_checkpointed_iteration.txt"
exit "$SRUN_STATUS"
"""


@pytest.mark.parametrize(
    "reached, status, extra, expect_requeue, expect_exit, said",
    [
        pytest.param("30", "143", [], True, 0, "requeueing job 9", id="stopped-by-sigterm-short-of-target"),
        pytest.param("100", "0", [], False, 0, "", id="reached-the-target"),
        pytest.param("10", "1", [], False, 1, "", id="failed-without-progress"),
        pytest.param("30", "0", ["--finetune"], False, 0, "--finetune would restart", id="finetune-never-requeued"),
        pytest.param("30", "0", ["RESTARTS"], False, 0, "requeued 50 times", id="requeued-too-often"),
    ],
)  # fmt: skip
def test_the_job_requeues_only_a_run_that_advanced_short_of_its_target(tmp_path, reached, status, extra,
                                                                       expect_requeue, expect_exit, said):  # fmt: skip
    """The requeue rule of examples/slurm/common.sh, with a stand-in srun that only moves the
    checkpoint tracker (from 10) and exits with a given status."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_PROGRESS_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    restarts = {"SLURM_RESTART_COUNT": "50"} if "RESTARTS" in extra else {}
    env = _env(SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="9", CHECKPOINT_DIR=str(ckpt), CKPT=str(ckpt),
               REACHED=reached, SRUN_STATUS=status, SCONTROL_LOG=str(tmp_path / "scontrol.log"),
               PATH=f"{bin_dir}:{os.environ['PATH']}", **restarts)  # fmt: skip
    flags = [f for f in extra if f != "RESTARTS"]
    proc = subprocess.run(["bash", "examples/slurm/pretrain_gpt.sbatch", "--train-iters", "100", *flags], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == expect_exit, proc.stdout + proc.stderr
    requeued = (tmp_path / "scontrol.log").exists()
    assert requeued == expect_requeue, proc.stdout
    assert said in proc.stdout and ("stopped at" in proc.stdout) == bool(said), proc.stdout
    if requeued:
        assert (tmp_path / "scontrol.log").read_text() == "requeue 9\n"
