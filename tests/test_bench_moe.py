"""tools/bench_moe.py: its layouts are flags the trainer takes, bad input is one line, the byte
counter counts a collective, the table shows ratios against TP; the whole run small (slow tier)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_slapo.arguments.parser import parse_args
from tools import bench_moe

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "layout", [layout for layout in bench_moe.LAYOUTS if not layout.hf], ids=lambda x: x.name.format(world=2)
)
def test_each_trainer_layout_is_flags_the_trainer_takes(layout, tmp_path):
    args = parse_args("gpt", [*bench_moe.trainer_flags(str(tmp_path), 256), *layout.trainer_flags(2)])
    assert (args.model_type, args.schedule, args.seq_length, args.log_comm) == ("qwen3_moe", "auto", 256, True)
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) in ((2, 1), (1, 2))


def test_the_baseline_is_tp_and_every_kind_is_there():
    names = [layout.name.format(world=2) for layout in bench_moe.LAYOUTS]
    assert names[0] == "TP2, experts split by features"
    assert {"EP2, alltoall", "EP2, allgather", "transformers EP2 + FSDP2"} <= set(names)
    config = bench_moe.model_config(bench_moe.parser().parse_args([]))
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.hidden_size) == (
        "qwen3_moe", 16, 2, 256)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--topk", "20"], "2", "--topk 20 is more than --experts 16"),
        (["--warmup", "8"], "2", "--warmup must leave some of --iters to time"),
        (["--hidden", "100"], "2", "--hidden 100 must be a multiple of 16"),
        ([], "3", "this launch has 3"),
        ([], "1", "this launch has 1"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(argv, world, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_:
        bench_moe.main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("bench_moe.py: error: ") and message in lines[-1], lines
    assert not dist.is_initialized()  # refused before the process group


def test_the_byte_counter_counts_a_collective_by_the_log_comm_rule(tmp_path):
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        counter = bench_moe.CollectiveBytes()
        with counter:
            dist.all_reduce(torch.ones(10))  # 40 bytes
            out = torch.empty(3 * dist.get_world_size())
            dist.all_gather_into_tensor(out, torch.ones(3))  # the gathered output
            torch.ones(5).sum()  # not a collective
        assert dict(counter.bytes) == {"all_reduce": 40, "all_gather": 12 * dist.get_world_size()}
    finally:
        if started:
            dist.destroy_process_group()


def test_the_table_shows_ratios_against_tp_and_why_a_row_did_not_run():
    rows = [{"layout": "TP2", "step_ms": 100.0, "tokens_per_s": 20.0, "bytes_per_step": 2**20, "time_vs_tp": 1.0,
             "bytes_vs_tp": 1.0, "bytes_by_kind": {"all_reduce[tp]": 2**20, "all_reduce[mp]": 4}},
            {"layout": "EP2", "step_ms": 50.0, "tokens_per_s": 40.0, "bytes_per_step": 2**21, "time_vs_tp": 0.5,
             "bytes_vs_tp": 2.0, "bytes_by_kind": {"all_to_all[ep]": 2**21}},
            {"layout": "transformers EP2", "skipped": "needs accelerate"}]  # fmt: skip
    lines = bench_moe.table(rows).splitlines()
    assert lines[2] == "| TP2 | 100 | 20 | 1.00x | 1.00 | 1.00x | all_reduce[tp] 1.00 |"  # 4 bytes: left out
    assert lines[3] == "| EP2 | 50 | 40 | 0.50x | 2.00 | 2.00x | all_to_all[ep] 2.00 |"
    assert lines[4] == "| transformers EP2 | not run: needs accelerate | | | | | |"


@pytest.mark.slow  # a torchrun launch training three layouts (and transformers' two where accelerate is installed)
def test_the_benchmark_times_every_layout_in_one_run(tmp_path):
    out = tmp_path / "moe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tools/bench_moe.py",
         "--layers", "1", "--hidden", "32", "--seq", "16", "--experts", "4", "--expert-width", "16", "--iters", "3",
         "--warmup", "1", "--rounds", "1", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {row["layout"]: row for row in data["rows"]}
    assert list(rows) == [layout.name.format(world=2) for layout in bench_moe.LAYOUTS]
    assert data["run"]["device"].startswith("CPU") and "bench_moe.py" in data["run"]["command"]
    tp, alltoall, allgather = rows["TP2, experts split by features"], rows["EP2, alltoall"], rows["EP2, allgather"]
    assert tp["time_vs_tp"] == 1.0 and tp["bytes_by_kind"]["all_reduce[tp]"] > 0
    assert alltoall["bytes_by_kind"]["all_to_all[ep]"] > 0 and "all_to_all[ep]" not in allgather["bytes_by_kind"]
    for row in data["rows"]:
        if "skipped" in row:
            assert row["layout"].startswith("transformers") and "accelerate" in row["skipped"]
            continue
        assert row["time_vs_tp"] == pytest.approx(row["step_ms"] / tp["step_ms"])
        assert row["bytes_vs_tp"] == pytest.approx(row["bytes_per_step"] / tp["bytes_per_step"])
        assert f"| {row['layout']} | {row['step_ms']:.0f} |" in proc.stdout
