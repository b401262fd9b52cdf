"""FP8 against bf16 on one device, with and without ``--compile``: real trainer steps, side by side
in one run, as tokens/s, model TFLOP/s, MFU and the speed-up over bf16.

    .venv/bin/python tools/bench_fp8.py --grid gpu [--warmup 3 --steps 5] [--json OUT]   # one H100/H200
    .venv/bin/python tools/bench_fp8.py --grid cpu [--json OUT]   # tiny models: FP8 emulated in fp32, a smoke test

Each model trains in four rows: ``--bf16``, ``--bf16 --fp8-format hybrid --fp8-recipe tensorwise``,
and both with ``--compile`` (every transformer layer compiled). A row is the single-process trainer
as ``pretrain_gpt.py`` would run it (``--schedule gpt_tp`` for GPT-2, ``llama_tp`` for Llama, mock
data, no dropout, one micro-batch a step), set up and stepped in this process by
:func:`~megatron_slapo.tuning.trial.measure_steps`: the median step time of ``--steps`` after
``--warmup`` (compilation happens there). Tokens/s, TFLOP/s (the model's FLOPs per token, counted
as the trainer's log line counts them, x tokens/s) and MFU against the device's dense bf16 peak
(:func:`~megatron_slapo.training.flops.device_peak_tflops`) follow. The speed-up is the bf16 row's
step time over the row's, for the same model and the same ``--compile`` setting, measured in this
run: above 1 FP8 is faster. On a CPU FP8 is emulated (its values multiplied in fp32): the CPU
grid checks that every row runs, not what FP8 gains.

The GPU grid: GPT-2 124M (sequence 1024, batch 8), the ~1B Llama of ``tools/bench.py``'s GPU grid
(sequence 2048, batch 4) and a slice of an 8B-shaped Llama (Llama 3 8B's layers: hidden 4096, FFN
14336, 32 heads in 8 key/value groups; 4 of them, sequence 8192, batch 1). The slice has a
32000-word vocabulary, not Llama 3's 128256: with 4 layers in place of 32, that head (kept in bf16)
would be 38% of the Linear products, against 7% in the whole 8B model; at 32000 it is 13%. The rows
run the eager ones of every model first, then the compiled ones, so that a run cut short by its
time limit has FP8 against bf16 for every model. The first row of a model (bf16, eager) decides its
sequence: out of memory, it is retried at half the sequence, down to the model's smallest (the
slice's: 2048), and the others run at the one that fit. A row that fails (out of memory, a compile
error) is reported with its one-line reason; the others run on. The trainer's own output goes to
stderr; the table and ``--json`` are the results.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from megatron_slapo import parallel  # noqa: E402
from megatron_slapo.arguments.fp8_flags import fp8_recipe  # noqa: E402
from megatron_slapo.arguments.parser import parse_args  # noqa: E402
from megatron_slapo.training.flops import device_peak_tflops  # noqa: E402
from megatron_slapo.tuning.trial import error_line, measure_steps  # noqa: E402
from tools.bench import device_name  # noqa: E402
from tools.bench_moe import revision  # noqa: E402

SCHEDULES = {"gpt2": "gpt_tp", "llama": "llama_tp"}  # the schedule each model type trains with on one device
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (FP8, --compile), in the table's order


@dataclass(frozen=True)
class Model:
    """One benchmarked model, as ``pretrain_gpt.py``'s size flags shape it."""

    name: str
    model_type: str  # a key of SCHEDULES
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int | None  # --num-query-groups (None: one key/value head per query head)
    vocab: int  # the model's words before the trainer pads them to a multiple of 128
    seq: int
    batch: int  # sequences a step, one micro-batch
    min_seq: int | None = None  # out of memory at seq: halve it down to this (None: no retry)

    def sizes(self) -> dict[str, str | int | None]:
        """The model's shape, for the JSON rows (the sequence and batch are a row's own)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("name", "seq", "batch", "min_seq")}

    def flags(self, seq: int, scratch: str) -> list[str]:
        """The trainer's flags for this model at ``seq`` in bf16; mock data cached under ``scratch``."""
        groups = ["--num-query-groups", str(self.kv_heads)] if self.kv_heads else []
        return ["--model-type", self.model_type, "--schedule", SCHEDULES[self.model_type], "--num-layers",
                str(self.layers), "--hidden-size", str(self.hidden), "--ffn-hidden-size", str(self.ffn),
                "--num-attention-heads", str(self.heads), *groups, "--seq-length", str(seq),
                "--micro-batch-size", str(self.batch), "--global-batch-size", str(self.batch), "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab - 1),  # and its end of document
                "--hidden-dropout", "0", "--attention-dropout", "0", "--bf16", "--lr", "1e-4", "--eval-iters", "0",
                "--num-workers", "0", "--data-cache-path", scratch]  # fmt: skip


GRIDS = {
    "gpu": [Model("gpt2 124M", "gpt2", 12, 768, 3072, 12, None, 50257, 1024, 8),
            Model("llama 1B", "llama", 16, 2048, 5632, 32, 8, 32000, 2048, 4),
            Model("llama 8B slice", "llama", 4, 4096, 14336, 32, 8, 32000, 8192, 1, min_seq=2048)],
    "cpu": [Model("gpt2 tiny", "gpt2", 2, 64, 256, 4, None, 512, 64, 2),
            Model("llama tiny", "llama", 2, 64, 128, 4, 2, 512, 64, 2)],
}  # fmt: skip


@dataclass
class Row:
    """One measured configuration: a model at a sequence, bf16 or FP8, eager or compiled."""

    model: str
    sizes: dict[str, str | int | None]
    seq: int
    batch: int
    recipe: str  # "bf16", or the FP8 recipe as the trainer describes it ("fp8 tensorwise hybrid (emulated)")
    compile: bool
    step_s: float | None = None  # median of the timed steps
    tokens_per_s: float | None = None
    tflops: float | None = None  # model TFLOP/s
    mfu: float | None = None  # against the device's bf16 peak; None where it is not known (a CPU)
    ratio: float | None = None  # the bf16 row's step time (same model and --compile) over this row's
    peak_mib: float | None = None  # the device's high-water mark in the row (None on a CPU)
    seconds: float = 0.0  # the row's wall time: set-up, compilation and every step
    note: str | None = None  # e.g. the sequences that ran out of memory before this one
    error: str | None = None  # why the row failed (one line)
    out_of_memory: bool = False


def measure(model: Model, seq: int, fp8: bool, compiled: bool, warmup: int, steps: int, scratch: str,
            peak: float | None) -> Row:  # fmt: skip
    """One row: the trainer set up and stepped in this process (``peak``: the bf16 peak its MFU is
    against); a failure is the row's ``error``."""
    argv = [*model.flags(seq, scratch), *(FP8 if fp8 else []), *(["--compile"] if compiled else [])]
    argv += ["--peak-tflops", str(peak)] if peak else []
    row = Row(model.name, model.sizes(), seq, model.batch, "fp8" if fp8 else "bf16", compiled)
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's own output
            if fp8:
                row.recipe = fp8_recipe(parse_args("gpt", argv)).describe()
            result = measure_steps("gpt", argv, warmup, steps)
    except Exception as e:  # whatever stops a row (out of memory, a compile error) leaves the others to run
        row.error = error_line(e)
        row.out_of_memory = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
    else:
        row.step_s, row.tokens_per_s, row.tflops = result["step_seconds"], result["per_second"], result["tflops"]
        row.mfu = result["mfu_percent"] / 100 if result["mfu_percent"] is not None else None
        row.peak_mib = result["peak_bytes"] / 2**20 if torch.cuda.is_available() else None
    _release()
    row.seconds = time.perf_counter() - start
    return row


def _release() -> None:
    """Free what a row left behind before the next: its compiled graphs, its model and optimizer
    (held in reference cycles), the allocator's cached blocks."""
    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fitted(model: Model, warmup: int, steps: int, scratch: str, peak: float | None) -> Row:
    """The model's bf16 eager row at the largest of ``seq``, ``seq / 2``, ... (down to ``min_seq``)
    that does not run out of memory; its ``note`` names the sequences that did."""
    seq, ran_out = model.seq, []
    row = measure(model, seq, False, False, warmup, steps, scratch, peak)
    while row.out_of_memory and model.min_seq and seq // 2 >= model.min_seq:
        ran_out.append(seq)
        seq //= 2
        row = measure(model, seq, False, False, warmup, steps, scratch, peak)
    if ran_out:
        row.note = f"out of memory at sequence {', '.join(map(str, ran_out))}"
    return row


def with_ratios(rows: list[Row]) -> list[Row]:
    """``rows`` in the table's order (by model, then :data:`VARIANTS`), each with its speed-up over
    the bf16 row of its model and ``--compile`` setting (None where either failed)."""
    order = {name: i for i, name in enumerate(dict.fromkeys(r.model for r in rows))}
    rows = sorted(rows, key=lambda r: (order[r.model], VARIANTS.index((r.recipe != "bf16", r.compile))))
    base = {(r.model, r.compile): r.step_s for r in rows if r.recipe == "bf16"}
    for r in rows:
        b = base.get((r.model, r.compile))
        r.ratio = b / r.step_s if b and r.step_s else None
    return rows


def run(models: list[Model], warmup: int, steps: int, peak: float | None,
        report: Callable[[list[Row], Row], None]) -> list[Row]:  # fmt: skip
    """Every row of every model, the eager ones first; ``report(rows so far, the new row)`` after each."""
    rows: list[Row] = []
    seqs: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as scratch:
        for compiled in (False, True):
            for model in models:
                for fp8 in (False, True):
                    if not fp8 and not compiled:
                        row = fitted(model, warmup, steps, scratch, peak)
                        seqs[model.name] = row.seq
                    else:
                        row = measure(model, seqs[model.name], fp8, compiled, warmup, steps, scratch, peak)
                    rows = with_ratios([*rows, row])
                    report(rows, row)
    parallel.destroy()
    return rows


def _cell(value: float | None, form: str) -> str:
    return "n/a" if value is None else format(value, form)


def table(rows: list[Row]) -> str:
    """The rows as Markdown: a failed row says why."""
    lines = ["| model | seq x batch | recipe | compile | step ms | tokens/s | TFLOP/s | MFU | vs bf16 | peak MiB "
             "| row s | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        head = f"| {r.model} | {r.seq} x {r.batch} | {r.recipe} | {'yes' if r.compile else 'no'} |"
        if r.error:
            lines.append(f"{head} failed: {r.error} | | | | | | {r.seconds:.0f} | {r.note or ''} |")
            continue
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.2f}x"
        lines.append(f"{head} {r.step_s * 1e3:.1f} | {r.tokens_per_s:.0f} | {r.tflops:.3f} | {_cell(r.mfu, '.1%')} "
                     f"| {ratio} | {_cell(r.peak_mib, '.0f')} | {r.seconds:.0f} | {r.note or ''} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_fp8.py", description=__doc__.splitlines()[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row; the median is reported")
    p.add_argument("--peak-tflops", type=float, help="the device's bf16 peak, for MFU (default: known GPUs)")
    p.add_argument("--json", metavar="FILE", help="write every row, with the command, date and device, as JSON")
    a = p.parse_args(argv)
    if a.warmup < 2 or a.steps < 1:
        p.error(f"--warmup {a.warmup} --steps {a.steps}: give a warm-up of 2 or more (a compiled layer compiles its "
                "forward, then its backward) and 1 or more timed steps")  # fmt: skip
    if a.json and not Path(a.json).resolve().parent.is_dir():
        p.error(f"--json {a.json}: directory {Path(a.json).resolve().parent} does not exist")
    peak = device_peak_tflops(a.peak_tflops)
    info = {"command": " ".join(["tools/bench_fp8.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device_name(),
            "peak_tflops": peak, "warmup": a.warmup, "steps": a.steps, "torch": torch.__version__,
            "commit": revision()}  # fmt: skip

    def report(rows: list[Row], row: Row) -> None:  # each row shown, and the JSON rewritten, as soon as it is measured
        print(table([row]).splitlines()[-1], flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"run": info, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))

    rows = run(GRIDS[a.grid], a.warmup, a.steps, peak, report)
    mfu = f"MFU against a bf16 peak of {peak:g} TFLOP/s" if peak else "no MFU (no known peak: --peak-tflops)"
    print(f"\ntools/bench_fp8.py --grid {a.grid} on {info['device']}: median of {a.steps} steps after {a.warmup}; "
          f"{mfu}; vs bf16: the bf16 row's step time (same model, same --compile) over the row's\n")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
