"""tools/bench_context.py: its launches are flags the trainer takes, it reads the trainer's memory and
iteration lines, the table shows ratios against CP1 and the budget, bad input is one line; the whole
run small (slow tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.arguments.parser import parse_args
from tools import bench_context

ROOT = Path(__file__).resolve().parents[1]

LOG = """\
 > memory measured in iteration 1 (peak: saved activations + parameters + gradients + optimizer):
 > rank 0 (tensor, pipeline, data, context) = (0, 0, 0, 0): parameters 2.38 MiB | gradients 2.38 MiB | optimizer 4.75 MiB
 > rank 0 (tensor, pipeline, data, context) = (0, 0, 0, 0): activations 10.50 MiB per micro-batch | peak 20.00 MiB
 > rank 1 (tensor, pipeline, data, context) = (0, 0, 0, 1): activations 11.00 MiB per micro-batch | peak 21.50 MiB
[2026-11-27 01:10:01] iteration        1/       3 | consumed samples:            1 | elapsed time per iteration (ms): 112.8 | lm loss: 8.346545E+00 | loss scale: 1.0 |
[2026-11-27 01:10:01] iteration        2/       3 | consumed samples:            2 | elapsed time per iteration (ms): 60.0 | lm loss: 8.327802E+00 | loss scale: 1.0 |
[2026-11-27 01:10:02] iteration        3/       3 | consumed samples:            3 | elapsed time per iteration (ms): 70.0 | lm loss: 8.308733E+00 | loss scale: 1.0 |
"""  # noqa: E501  (the trainer's lines as it prints them)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_launch_is_flags_the_trainer_takes(cp, tmp_path):
    command = bench_context.trainer_command(cp, 64, 3, "allgather", str(tmp_path))
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"] and f"--nproc_per_node={cp}" in command
    args = parse_args("gpt", command[command.index(str(ROOT / "pretrain_gpt.py")) + 1 :])
    assert (args.model_type, args.schedule, args.seq_length, args.train_iters) == ("llama", "llama_tp", 64, 3)
    assert (args.context_parallel_size, args.cp_comm_type) == (cp, "allgather" if cp > 1 else "p2p")
    assert (args.hidden_dropout, args.attention_dropout, args.micro_batch_size) == (0, 0, 1)
    assert args.tensorboard_dir.startswith(str(tmp_path)) and args.data_cache_path.startswith(str(tmp_path))


def test_the_log_gives_every_ranks_memory_the_steps_and_the_last_loss():
    measured = bench_context.parse_log(LOG, 2, max_rss_mib=500.0)
    assert (measured.activations_mib, measured.peak_mib) == ([10.5, 11.0], [20.0, 21.5])
    assert (measured.step_ms, measured.last_loss, measured.max_rss_mib) == ([112.8, 60.0, 70.0], 8.308733, 500.0)
    with pytest.raises(ValueError, match="every one of the 4 ranks"):
        bench_context.parse_log(LOG, 4, max_rss_mib=500.0)


def test_the_table_shows_ratios_against_cp1_the_budget_and_a_failed_layout():
    cp1 = bench_context.Measured(1, [400.0], [800.0], [900.0, 100.0, 300.0], 8.0, 1000.0)
    cp2 = bench_context.Measured(2, [100.0, 90.0], [300.0, 310.0], [50.0, 100.0, 100.0], 8.0, 500.0)
    rows = bench_context.rows([cp1, cp2, "exit code 1: out of memory"], [1, 2, 4], budget=600, cpu=True)
    assert rows[0]["step_ms"] == 200.0  # the first step is not timed
    assert rows[1]["activations_mib"] == 100.0 and rows[1]["activations_mib vs base"] == 0.25
    assert [r.get("fits_budget") for r in rows] == [False, True, None]  # CP1's RSS is over 600 MiB
    lines = bench_context.table(rows, 600).splitlines()
    assert lines[0].startswith("| layout | ranks | activations MiB / micro-batch (largest rank) | / CP1's |")
    assert lines[0].endswith("| within 600 MiB |") and lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| CP1 | 1 | 400.0 | 1.00x | 800.0 | 1.00x | 1000 | 1.00x | 200 | 1.00x | 8.000000 | no |"
    assert lines[3] == "| CP2 | 2 | 100.0 | 0.25x | 310.0 | 0.39x | 500 | 0.50x | 100 | 0.50x | 8.000000 | yes |"
    assert lines[4].startswith("| CP4 | 4 | failed: exit code 1: out of memory |") and lines[4].count("|") == 13
    gpu = bench_context.rows([cp1], [1], budget=900, cpu=False)  # a GPU's budget: the peak (RSS is the host's)
    assert gpu[0]["fits_budget"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-length", "100", "--layouts", "1", "4"], "--seq-length 100 must be a positive multiple of 2 x 4"),
        (["--layouts", "2", "2"], "give distinct context-parallel sizes"),
        (["--layouts", "0"], "give distinct context-parallel sizes of 1 or more"),
        (["--iters", "1"], "--iters 1: give 2 or more"),
        (["--memory-budget-mib", "0"], "--memory-budget-mib 0 must be positive"),
        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: directory"),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench_context, "launch", lambda *a: pytest.fail("launched"))
    with pytest.raises(SystemExit) as exit_:
        bench_context.main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("bench_context.py: error: ") and message in lines[-1], lines


@pytest.mark.slow  # two trainer launches (CP1, then two ranks at CP2)
def test_the_benchmark_trains_cp1_and_cp2_in_one_run(tmp_path):
    out, logs = tmp_path / "context.json", tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "tools/bench_context.py", "--seq-length", "64", "--layouts", "1", "2", "--iters", "2",
         "--memory-budget-mib", "100000", "--json", str(out), "--logs", str(logs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    cp1, cp2 = data["rows"]
    assert (cp1["layout"], cp2["layout"]) == ("CP1", "CP2") and sorted(p.name for p in logs.iterdir()) == [
        "cp1.log", "cp2.log"]  # fmt: skip
    assert len(cp2["activations_mib_per_rank"]) == 2 and cp2["activations_mib"] < cp1["activations_mib"]
    assert cp2["activations_mib vs base"] == pytest.approx(cp2["activations_mib"] / cp1["activations_mib"])
    assert cp1["last_loss"] == pytest.approx(cp2["last_loss"], abs=1e-5)  # the same model, the same tokens
    assert cp1["fits_budget"] and cp2["fits_budget"] and cp1["max_rss_mib"] > 0
    assert data["run"]["machine"].startswith("CPU") and "--layouts 1 2" in data["run"]["command"]
    for row in data["rows"]:
        assert f"| {row['layout']} | {row['ranks']} | {row['activations_mib']:.1f} |" in proc.stdout
