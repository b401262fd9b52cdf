"""One auto-tuner trial, under torchrun: a few real training steps of one configuration, timed,
and the result written as JSON (``tools/autotune.py`` reads the file, never the log).

    .venv/bin/torchrun --nproc_per_node 2 -m megatron_slapo.tuning.trial --out result.json --task gpt \\
        --warmup 1 --steps 3 -- <pretrain_gpt.py flags>

The trainer's own :func:`~megatron_slapo.training.run.setup` builds the run, so a trial is the
run the printed command starts. After ``--warmup`` steps (compilation, DeepSpeed's first-step
bookkeeping), each of ``--steps`` steps is timed on every rank between barriers and counted as the
slowest rank's time; the median is the result, with throughput, model TFLOP/s and MFU (as the
log line counts them) and the loss. Peak memory is the device's high-water mark (CUDA), else the
process's resident set. Any failure (an input error, a CUDA out-of-memory) is a result too:
``{"error": ...}``. :func:`measure_steps` is the measurement alone, for a benchmark that times
several configurations in one process (``tools/bench_fp8.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_slapo import parallel
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.data.samplers import data_loader
from megatron_slapo.training.run import Run, setup


@contextlib.contextmanager
def step_batches(run: Run) -> Iterator[Callable[[], list[dict]]]:
    """``next_step()``: the micro-batches of the next step from the start of the training data,
    for steps taken outside :func:`~megatron_slapo.training.loop.train` (a trial, a measurement)."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )

    args, dp = run.args, run.args.data_parallel_size
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, dp)
    try:
        n_micro = get_num_microbatches()
        batches = iter(data_loader(run.datasets[0], 0, args.micro_batch_size, run.layout.data_rank, dp, 0))
        yield lambda: [next(batches) for _ in range(n_micro)]
    finally:
        destroy_num_microbatches_calculator()
        run.reporter.close()


def measure_steps(task: str, argv: list[str], warmup: int, steps: int) -> dict:
    """Set up ``pretrain_<task>.py <argv>`` in this process and time ``steps`` training steps after
    ``warmup``: their median (the slowest rank's), throughput, TFLOP/s and MFU (``mfu_percent``:
    None without a known peak), peak memory (the device's since this call) and the last metrics."""
    args = parse_args(task, argv)
    args.train_iters = max(args.train_iters or 0, warmup + steps)  # the data must cover the trial
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # this run's peak, where one process measures several
    run = setup(args)
    with step_batches(run) as next_step:
        times, loss = [], None
        for i in range(warmup + steps):
            micro = next_step()
            dist.barrier()
            start = time.perf_counter()
            result = run.engine.train_step(micro, run.task)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            if i >= warmup:
                times.append(took.item())
            loss = {k: float(v) for k, v in result.metrics.items()}
    seconds = statistics.median(times)
    unit = args.global_batch_size * (1 if task == "vision" else run.settings.seq_length)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    peak_all = torch.tensor([peak], dtype=torch.float64)
    dist.all_reduce(peak_all, op=dist.ReduceOp.MAX)
    tflops, _, mfu = run.reporter.rates(seconds)
    return {"step_seconds": seconds, "per_second": unit / seconds, "unit": "samples" if task == "vision" else "tokens",
            "tflops": tflops, "mfu_percent": mfu, "peak_bytes": int(peak_all.item()), "steps": times,
            "metrics": loss}  # fmt: skip


def error_line(error: BaseException) -> str:
    """A failure as a result's one line: its type and the first line of its message."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:500]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megatron_slapo.tuning.trial")
    parser.add_argument("--out", required=True)
    parser.add_argument("--task", choices=("gpt", "bert", "t5", "vision"), default="gpt")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("trainer", nargs=argparse.REMAINDER, help="-- then the trainer's flags")
    ours = parser.parse_args(argv)
    trainer = ours.trainer[1:] if ours.trainer[:1] == ["--"] else ours.trainer
    try:
        result = measure_steps(ours.task, trainer, ours.warmup, ours.steps)
    except (ValueError, RuntimeError, FileNotFoundError) as e:  # input errors, out of memory: the result
        result = {"error": error_line(e)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(ours.out, "w") as f:
            json.dump(result, f)
    parallel.destroy()
    sys.exit(0 if "error" not in result else 1)


if __name__ == "__main__":
    main()
