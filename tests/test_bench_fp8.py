"""tools/bench_fp8.py: its GPU rows are flags the trainer takes (the 8B-shaped slice as the issue
shapes it), an out-of-memory first row retries at half the sequence and the others follow it, a
failed row is reported and the others run; the CPU grid's whole run, every row with a speed-up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from tests.utils import require_compiler
from tools import bench_fp8

ROOT = Path(__file__).resolve().parents[1]
GPU = {model.name: model for model in bench_fp8.GRIDS["gpu"]}


@pytest.mark.parametrize("model", bench_fp8.GRIDS["gpu"], ids=lambda m: m.name)
def test_each_gpu_row_is_flags_the_trainer_takes(model, tmp_path):
    flags = [*model.flags(model.seq, str(tmp_path)), *bench_fp8.FP8, "--compile"]
    args = parse_args("gpt", [*flags, "--train-iters", "8"])  # as measure_steps sets it
    validate_args(args, 1)
    assert (args.schedule, args.bf16, args.compile) == (bench_fp8.SCHEDULES[model.model_type], True, True)
    assert (args.fp8_format, args.fp8_recipe, args.mock_data) == ("hybrid", "tensorwise", True)
    assert (args.micro_batch_size, args.global_batch_size, args.seq_length) == (model.batch, model.batch, model.seq)


def test_the_grid_has_the_three_models_the_issue_names():
    assert list(GPU) == ["gpt2 124M", "llama 1B", "llama 8B slice"]
    s = GPU["llama 8B slice"]
    assert (s.hidden, s.ffn, s.heads, s.kv_heads, s.layers, s.seq, s.batch, s.min_seq) == (
        4096, 14336, 32, 8, 4, 8192, 1, 2048)  # fmt: skip
    assert (GPU["llama 1B"].layers, GPU["llama 1B"].hidden, GPU["gpt2 124M"].layers) == (16, 2048, 12)


def _fake_measure(fits: int, calls: list):
    """A stand-in for a row's measurement: out of memory above ``fits`` tokens, else one second a step."""

    def measure(model, seq, fp8, compiled, *rest):
        calls.append((seq, fp8, compiled))
        row = bench_fp8.Row(model.name, model.sizes(), seq, model.batch, "fp8" if fp8 else "bf16", compiled)
        if seq > fits:
            row.error, row.out_of_memory = "OutOfMemoryError: CUDA out of memory", True
        else:
            row.step_s, row.tokens_per_s, row.tflops = 1.0 if not fp8 else 0.5, 1.0, 1.0
        return row

    return measure


def test_an_out_of_memory_first_row_halves_the_sequence_and_the_others_follow(monkeypatch):
    calls, reported = [], []
    monkeypatch.setattr(bench_fp8, "measure", _fake_measure(2048, calls))
    rows = bench_fp8.run([GPU["llama 8B slice"]], 3, 5, None, lambda rows, row: reported.append(row))
    assert calls == [(8192, False, False), (4096, False, False), (2048, False, False), (2048, True, False),
                     (2048, False, True), (2048, True, True)]  # fmt: skip
    assert rows[0].note == "out of memory at sequence 8192, 4096" and {r.seq for r in rows} == {2048}
    assert [r.ratio for r in rows] == [1.0, 2.0, 1.0, 2.0] and len(reported) == 4


def test_a_failed_row_says_why_and_the_others_run(tmp_path):
    bad = bench_fp8.Model("bad", "llama", 2, 64, 128, 5, None, 512, 64, 2)  # 5 heads do not divide 64
    row = bench_fp8.measure(bad, 64, True, False, 2, 1, str(tmp_path), None)
    assert row.error and "num-attention-heads" in row.error and row.step_s is None and not row.out_of_memory
    ok = bench_fp8.Row("bad", bad.sizes(), 64, 2, "bf16", False, step_s=0.5, tokens_per_s=256.0, tflops=0.1)
    rows = bench_fp8.with_ratios([row, ok])
    assert [(r.recipe[:4], r.ratio) for r in rows] == [("bf16", 1.0), ("fp8 ", None)]  # bf16 first, whatever the order
    line = bench_fp8.table(rows).splitlines()[3]
    assert line.startswith(f"| bad | 64 x 2 | {row.recipe} | no | failed: {row.error} |") and line.count("|") == 13


def test_the_cpu_grid_measures_every_row_side_by_side(tmp_path):
    require_compiler()  # half the rows compile every layer
    out = tmp_path / "fp8.json"
    proc = subprocess.run(
        [sys.executable, "tools/bench_fp8.py", "--grid", "cpu", "--warmup", "2", "--steps", "2", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["run"]["device"].startswith("CPU") and "--grid cpu" in data["run"]["command"]
    assert [(r["model"], r["recipe"] != "bf16", r["compile"]) for r in rows] == [
        (model.name, fp8, compiled) for model in bench_fp8.GRIDS["cpu"] for fp8, compiled in bench_fp8.VARIANTS
    ]
    for r in rows:
        assert r["error"] is None and r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None  # no CPU peak
        base = next(b for b in rows if (b["model"], b["compile"], b["recipe"]) == (r["model"], r["compile"], "bf16"))
        assert r["ratio"] == pytest.approx(base["step_s"] / r["step_s"])
        assert r["recipe"] in ("bf16", "fp8 tensorwise hybrid (emulated)")
        assert f"| {r['model']} | 64 x 2 | {r['recipe']} | {'yes' if r['compile'] else 'no'} |" in proc.stdout
