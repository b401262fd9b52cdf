"""The entry points as a user runs them: bad input is one error line, even under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import require_compiler

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


UNKNOWN_SCHEDULE = ("pretrain_gpt.py: error: unknown schedule 'nope'; available: default, gpt_tp, gpt_fused, "
                    "gpt_neo_tp, opt_tp, llama_tp, bert_tp, t5_tp, wideresnet_tp, auto")  # fmt: skip


def assert_one_line_and_root_cause(proc: subprocess.CompletedProcess, line: str) -> None:
    """The job printed ``line`` once, and torchrun's summary names it as the root cause."""
    output = proc.stdout + proc.stderr
    printed = [text for text in output.splitlines() if text.startswith("pretrain_gpt.py: error:")]
    assert printed == [line], output[-3000:]
    root_cause = output.split("Root Cause (first observed failure):")[-1]
    assert f"traceback : {line}" in root_cause, output[-3000:]


@pytest.mark.slow  # a whole torchrun launch: CI's slow tier
def test_one_error_line_under_torchrun_before_anything_starts():
    proc = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "pretrain_gpt.py", "--schedule", "nope")  # fmt: skip
    assert proc.returncode != 0
    assert_one_line_and_root_cause(proc, UNKNOWN_SCHEDULE)


@pytest.mark.slow  # a whole torchrun launch: CI's slow tier
def test_the_error_line_survives_rank_0_failing_last(tmp_path):
    """torchrun stops every worker when the first exits: rank 1 must not cut rank 0 off before it
    prints. Rank 0 starts late here, so rank 1 meets the error first."""
    late_rank_0 = tmp_path / "late_rank_0.py"
    late_rank_0.write_text(
        "import os, runpy, sys, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(5)\n"
        f"sys.argv[0] = {str(ROOT / 'pretrain_gpt.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(late_rank_0), "--schedule", "nope")  # fmt: skip
    assert proc.returncode != 0
    assert_one_line_and_root_cause(proc, UNKNOWN_SCHEDULE)


def test_single_process_error_exit_code_and_no_traceback():
    proc = run(sys.executable, "pretrain_bert.py", "--global-batch-size", "3", "--micro-batch-size", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pretrain_bert.py: error: global batch size (3) is not divisible by micro batch size (2) x data-parallel size (1)"
    ]


def test_library_example_trains():
    proc = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "examples/train_gpt_tp.py", "--steps", "5")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tensor parallelism 2" in proc.stdout and "step    5 | lm loss" in proc.stdout


def test_the_benchmark_runs_every_schedule_both_ways():
    """tools/bench_collectives.py on a tiny model: one row per schedule; the shipped plans all-reduce less
    than one reduction per projection does, except GPT-2's (fused q|k|v already), never more. No
    config has a special token outside the small vocabulary (transformers would warn of it)."""
    proc = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tools/bench_collectives.py",
               "--hidden-size", "32", "--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "16",
               "--vocab-size", "128", "--warmup", "0", "--steps", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "_token_id" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    rows = {cells[1].strip(): cells for line in proc.stdout.splitlines() if (cells := line.split("|"))[1:2]
            and cells[1].strip().endswith("_tp")}  # fmt: skip
    assert sorted(rows) == ["bert_tp", "gpt_neo_tp", "gpt_tp", "llama_tp", "opt_tp"], proc.stdout
    reduced = {name: (int(c[5].replace(",", "")), int(c[6].replace(",", ""))) for name, c in rows.items()}
    assert reduced["gpt_tp"][0] == reduced["gpt_tp"][1]
    assert all(before > after for name, (before, after) in reduced.items() if name != "gpt_tp"), reduced


@pytest.mark.slow
def test_the_benchmark_times_a_recipe_against_hf_eager_in_one_run(tmp_path):
    """tools/bench.py --grid tiny: one row, both sides timed in the same run; JSON and PNG written; no
    special token outside the tiny vocabulary (transformers would warn of it)."""
    require_compiler()  # its recipe, gpt_fused, compiles every layer
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = run(sys.executable, "tools/bench.py", "--grid", "tiny", "--warmup", "2", "--steps", "2", "--json", str(out),
               "--plot", str(png))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "_token_id" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["recipe"] == "gpt_fused" and row["dtype"] == "fp32"
    assert len(row["hf"]["step_ms_all"]) == len(row["scheduled"]["step_ms_all"]) == 2
    assert row["speedup"] == pytest.approx(row["hf"]["step_ms"] / row["scheduled"]["step_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| gpt2 tiny | 32 x 2 | fp32 | gpt_fused |" in proc.stdout


def test_loc_counts_schedule_lines_beside_slapos():
    """tools/loc.py: Slapo's Table 4 count (code lines, less docstrings, comments, imports, the
    MODEL_TYPES declaration and closing brackets); every schedule but T5's at or under Slapo's number."""
    sys.path.insert(0, str(ROOT / "tools"))
    from loc import count_lines

    source = '''"""Doc."""
import torch  # an import
MODEL_TYPES = ("gpt2",)
# a comment
PLAN = {
    "a": 1,  # one entry
    "b": (2,
          3),
}
apply = make(PLAN)
'''
    assert count_lines(source) == 5  # PLAN = {, "a", "b" over two lines, apply
    proc = run(sys.executable, "tools/loc.py")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()[2:]]
    schedules = {"gpt_tp", "gpt_fused", "gpt_neo_tp", "opt_tp", "llama_tp", "bert_tp", "t5_tp", "wideresnet_tp", "auto"}
    assert {r[0].strip() for r in rows} == schedules
    # t5_tp is over: Slapo's 11 lines swap in EPOI's pre-written T5 attention modules, where t5_tp
    # places HF's own (fused k|v, the relative bias by head, both FFN kinds) in 18 (docs/benchmarks.md)
    assert all(r[4].strip() == "yes" for r in rows if r[0].strip() != "t5_tp"), proc.stdout
    assert [int(r[2]) for r in rows if r[0].strip() == "t5_tp"] == [18], proc.stdout  # no more than documented


def test_plot_draws_the_loss_and_throughput_of_each_run(tmp_path):
    """tools/plot.py: a panel per tag, a line per run (a resumed run's event files together); a tag
    no run has is one error line naming those there are."""
    from torch.utils.tensorboard import SummaryWriter

    for name, offset in (("a", 0.0), ("b", 0.5)):
        for first, last in ((1, 4), (4, 7)):  # written by two processes, as a resumed run
            with SummaryWriter(str(tmp_path / name)) as writer:
                for step in range(first, last):
                    writer.add_scalar("lm loss", 8 - step + offset, step)
                    writer.add_scalar("throughput(tps)", 1000 + step, step)
    from tools.plot import read_scalars

    assert read_scalars(str(tmp_path / "b"))["lm loss"] == {step: 8.5 - step for step in range(1, 7)}
    png = tmp_path / "curves.png"
    proc = run(sys.executable, "tools/plot.py", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"{png}: lm loss, throughput(tps) for 2 run(s)"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = run(sys.executable, "tools/plot.py", "--tag", "accuracy", str(tmp_path / "a"), "--out", str(png))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "plot.py: no run has ['accuracy']; the runs have: lm loss, throughput(tps)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("suite", ["fig7", "fig9"])
def test_the_papers_suites_time_every_system_and_plot_them(tmp_path, suite):
    """tools/bench_suites.py on two CPU ranks, a tiny GPT-2: a row per system (Figure 7: HF eager,
    DeepSpeed, megatron-core's GPTModel, gpt_tp; Figure 9: the ablation), each with its step time
    and its speed-up over the first, HF eager; the JSON, the table and the PNG."""
    if suite == "fig9":
        require_compiler()  # from "+ kernels" on, the layers are compiled
    out, png = tmp_path / f"{suite}.json", tmp_path / f"{suite}.png"
    proc = run(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "tools/bench_suites.py", "--suite", suite, "--iters", "3", "--warmup", "1", "--rounds", "1",
               "--json", str(out), "--plot", str(png), "--", "--num-layers", "2", "--hidden-size", "32",
               "--num-attention-heads", "4", "--seq-length", "16", "--global-batch-size", "8")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["results"]
    from tools.bench_suites import SUITES

    assert data["run"]["device"].startswith("CPU") and "bench_suites.py --suite" in data["run"]["command"]
    assert [r["system"] for r in rows] == list(SUITES[suite])
    assert rows[0]["speedup"] == 1.0 and all(r["ranks"] == 2 and r["step_ms"] > 0 for r in rows)
    for r in rows:
        assert r["speedup"] == pytest.approx(rows[0]["step_ms"] / r["step_ms"])
        assert f"| {r['system']} | 2 | {r['step_ms']:.0f} |" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
