"""The Megatron log line and TensorBoard scalars (written by the last rank, as Megatron does).

The line keeps Megatron-LM's fields, order and number formats, then adds tokens/s and MFU::

    [2026-11-22 10:00:00] iteration       20/     100 | consumed samples:          640 | elapsed time per
    iteration (ms): 812.3 | throughput per GPU (TFLOP/s/GPU): 41.2 | learning rate: 1.500000E-04 | global
    batch size:    32 | lm loss: 6.512345E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped
    iterations:   0 | number of nan iterations:   0 | tokens per second: 40210 | MFU: 4.2% |

TensorBoard gets Megatron's tags (``lm loss``, ``lm loss vs samples``, ``learning-rate``,
``batch-size``, ``iteration-time``, ``throughput``, ``loss-scale``, ``grad-norm``, ``world-size``,
``lm loss validation`` ...) plus torchtitan's ``throughput(tps)``, ``tflops`` and ``mfu(%)``, and with
``--log-comm`` the bytes of each collective per step (``comm-bytes/all_reduce[tp]`` ...). Memory is in
MiB, as ``tools/explain.py`` gives it: after the first step every rank's measured activations per
micro-batch and peak (``memory/rank0 activations (MiB per micro-batch)``, ``memory/rank0 peak (MiB)``).

A run without ``--tensorboard-dir`` on the embedded corpus or an image model writes to
``runs/<task>-<model type>-<layers>x<hidden>-tp<T>pp<P>dp<D>-<schedule>/<time>`` (:func:`run_name`),
and a run resumed from its checkpoint goes on in that folder, so that TensorBoard draws one curve;
a run on its own data writes none unless asked, as Megatron's.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_slapo.engines.base import Engine, ModelShape, StepResult, metrics_to_floats
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training.memory import StepMemory, StepMeter

if TYPE_CHECKING:
    from megatron_slapo.training.settings import RunSettings

MiB = 2**20


def print_rank_0(*values: Any) -> None:
    """Print once for the job: on rank 0, or in a process without process groups."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*values, flush=True)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def run_name(settings: RunSettings, shape: ModelShape, layout: Layout, data_parallel: int) -> str:
    """What ran, as a directory name: ``gpt-gpt2-4x256-tp2pp1dp1-gpt_tp`` (task, model type, layers x
    hidden size, the tensor x pipeline x data layout (x context, ``cp2``, when split), schedule)."""
    size = f"{shape.num_layers}x{shape.hidden_size}"
    where = f"tp{layout.tp_size}pp{layout.pp_size}dp{data_parallel}" + (
        f"cp{layout.cp_size}" if layout.cp_size > 1 else ""
    )
    return "-".join((settings.task, settings.model_type, size, where, settings.schedule))


def tensorboard_dir(args: argparse.Namespace, settings: RunSettings, shape: ModelShape, layout: Layout,
                    resumed: str | None = None) -> str | None:  # fmt: skip
    """``--tensorboard-dir``; else, for a run with no data flags (the embedded corpus, an image
    model), ``resumed``, the folder of the run it resumes (its checkpoint records it), while that
    folder can be written, or a new ``runs/<run_name>/<time>``; else None: a run on its own data
    writes TensorBoard only where asked, as Megatron's."""
    if args.tensorboard_dir or not (args.embedded_data or settings.task == "vision"):
        return args.tensorboard_dir
    if resumed and os.path.isdir(resumed) and os.access(resumed, os.W_OK):
        return resumed
    name = run_name(settings, shape, layout, args.data_parallel_size)
    return os.path.join("runs", name, time.strftime("%Y%m%d-%H%M%S"))


def memory_stats() -> dict[str, float]:
    """Device memory (CUDA) or the process's peak resident set (CPU), in bytes."""
    if torch.cuda.is_available():
        return {
            "mem-allocated-bytes": torch.cuda.memory_allocated(),
            "mem-max-allocated-bytes": torch.cuda.max_memory_allocated(),
            "mem-reserved-bytes": torch.cuda.memory_reserved(),
        }
    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def log_engine_memory(report: dict[str, int], layout: Layout) -> None:
    """Print every rank's parameter, gradient and optimizer bytes (from rank 0, in rank order)."""
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (layout.coordinates(), report))
    if dist.get_rank() == 0:
        for rank, ((names, place), r) in enumerate(rows):
            mib = {k: v / MiB for k, v in r.items()}
            print(f" > rank {rank} {names} = {place}: parameters {mib['params']:.2f} MiB "
                  f"| gradients {mib['grads']:.2f} MiB | optimizer {mib['optimizer']:.2f} MiB", flush=True)  # fmt: skip


class Reporter:
    """Accumulates a log interval of steps; prints the log line; writes TensorBoard scalars."""

    def __init__(self, args: argparse.Namespace, flops_per_iteration: float, per_iteration: int,
                 peak_tflops: float | None, unit: str = "tokens", tensorboard: str | None = None) -> None:  # fmt: skip
        """``per_iteration``: the ``unit``s of a step, tokens, or samples for an image model;
        ``tensorboard``: the directory to write events to (:func:`tensorboard_dir`), or None."""
        self.args, self.unit = args, unit
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.is_last = (dist.get_rank() if dist.is_initialized() else 0) == self.world - 1
        self.flops, self.per_iteration, self.peak = flops_per_iteration, per_iteration, peak_tflops
        self.writer = None
        if self.is_last and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=tensorboard, max_queue=10)
            print(f"> writing TensorBoard events to {tensorboard}", flush=True)
        self._memory: StepMeter | None = None
        self._memory_measured = False
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}  # read at the log line only: no device sync per step
        self.steps = self.counted = self.skipped = self.nans = 0
        self.seconds = 0.0
        self.comm: dict[str, int] = {}

    def print(self, line: str) -> None:
        if self.is_last:
            print(line, flush=True)

    def rates(self, seconds_per_iteration: float) -> tuple[float, float, float | None]:
        """(model TFLOP/s per rank, units per second, MFU in percent or None without a peak) at
        ``seconds_per_iteration``: what the log line shows, and a trial reports."""
        tflops = self.flops / (seconds_per_iteration * 1e12 * self.world)
        per_second = self.per_iteration / seconds_per_iteration
        mfu = 100 * tflops / self.peak if self.peak else None
        return tflops, per_second, mfu

    def measure_memory(self, engine: Engine, micro_batches: int) -> contextlib.AbstractContextManager:
        """Around the first training step: measures its memory (:class:`StepMeter`), which the next
        :meth:`step` logs; around every later step, nothing."""
        if self._memory_measured:
            return contextlib.nullcontext()
        self._memory_measured = True
        self._memory = StepMeter(engine.model, engine.memory_report, micro_batches)
        return self._memory

    def _log_memory(self, iteration: int, measured: StepMemory) -> None:
        """Every rank's measured activations per micro-batch and peak, in MiB: printed by rank 0 in
        rank order (beside the engine's report at start), written to TensorBoard by the last rank."""
        layout = Layout.current()
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (layout.coordinates(), measured))
        if dist.get_rank() == 0:
            print(f" > memory measured in iteration {iteration} (peak: {measured.peak_source}):", flush=True)
            for rank, ((names, place), m) in enumerate(rows):
                print(f" > rank {rank} {names} = {place}: activations "
                      f"{m.activations / MiB:.2f} MiB per micro-batch | peak {m.peak / MiB:.2f} MiB", flush=True)  # fmt: skip
        if self.writer:
            for rank, (_, m) in enumerate(rows):
                self.writer.add_scalar(f"memory/rank{rank} activations (MiB per micro-batch)", m.activations / MiB,
                                       iteration)  # fmt: skip
                self.writer.add_scalar(f"memory/rank{rank} peak (MiB)", m.peak / MiB, iteration)

    def step(self, iteration: int, consumed: int, result: StepResult, seconds: float) -> None:
        """Record one iteration; print the line at every ``--log-interval``."""
        if self._memory is not None and self._memory.result is not None:
            self._log_memory(iteration, self._memory.result)
            self._memory = None
        self.steps += 1
        self.seconds += seconds
        self.skipped += int(result.skipped)
        for key, value in (result.comm or {}).items():
            self.comm[key] = self.comm.get(key, 0) + value
        if result.skipped or result.diverging:  # Megatron reads the loss of such a step only, to count NaNs
            self.nans += int(not result.loss_finite)
        else:  # and averages the losses of the steps taken
            self.counted += 1
            for k, v in result.metrics.items():
                self.sums[k] = self.sums.get(k, 0) + v
        if self.writer and iteration % self.args.tensorboard_log_interval == 0:
            self._scalars(iteration, consumed, result, seconds)
        if iteration % self.args.log_interval == 0:
            self._line(iteration, consumed, result)
            self._reset()

    def _scalars(self, iteration: int, consumed: int, result: StepResult, seconds: float) -> None:
        tflops, tps, mfu = self.rates(seconds)
        scalars = {
            "learning-rate": result.learning_rate, "batch-size": self.args.global_batch_size,
            "loss-scale": result.loss_scale, "world-size": self.world, "iteration-time": seconds,
            "throughput": tflops, f"throughput({self.unit[0]}ps)": tps, "tflops": tflops,
        }  # fmt: skip
        if mfu is not None:
            scalars["mfu(%)"] = mfu
        if result.grad_norm is not None:
            scalars["grad-norm"] = result.grad_norm
        if result.params_norm is not None:
            scalars["params-norm"] = result.params_norm
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, iteration)
        for tag in ("learning-rate", "batch-size", "loss-scale", "grad-norm", "params-norm"):
            if tag in scalars:
                self.writer.add_scalar(f"{tag} vs samples", scalars[tag], consumed)
        for key, value in (result.comm or {}).items():
            self.writer.add_scalar(f"comm-bytes/{key}", value, iteration)
        if self.args.log_memory_to_tensorboard:
            for tag, value in memory_stats().items():
                self.writer.add_scalar(tag, value, iteration)
        for name, value in metrics_to_floats(result.metrics).items():
            self.writer.add_scalar(name, value, iteration)
            self.writer.add_scalar(f"{name} vs samples", value, consumed)

    def _line(self, iteration: int, consumed: int, result: StepResult) -> None:
        per_iteration = self.seconds / max(self.steps, 1)
        tflops, tps, mfu = self.rates(per_iteration)
        counted = max(self.counted, 1)
        fields = [
            f"[{_now()}] iteration {iteration:8d}/{self.args.train_iters:8d}",
            f"consumed samples: {consumed:12d}",
            f"elapsed time per iteration (ms): {per_iteration * 1000:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}"
            if tflops >= 1
            else f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f}",
            f"learning rate: {result.learning_rate:.6E}",
            f"global batch size: {self.args.global_batch_size:5d}",
            *(f"{name}: {value / counted:.6E}" for name, value in sorted(metrics_to_floats(self.sums).items())),
            f"loss scale: {result.loss_scale:.1f}",
        ]
        if result.grad_norm is not None:
            fields.append(f"grad norm: {result.grad_norm:.3f}")
        if result.params_norm is not None:
            fields.append(f"params norm: {result.params_norm:.3f}")
        fields += [
            f"number of skipped iterations: {self.skipped:3d}",
            f"number of nan iterations: {self.nans:3d}",
            f"{self.unit} per second: {tps:.0f}",
            f"MFU: {mfu:.1f}%" if mfu is not None else "MFU: n/a (no peak FLOP/s known for a CPU; see --peak-tflops)",
        ]
        if self.comm:
            per_step = ", ".join(f"{k} {v / max(self.steps, 1) / MiB:.3f}" for k, v in sorted(self.comm.items()))
            fields.append(f"comm (MiB/step): {per_step}")
        self.print(" | ".join(fields) + " |")

    def validation(self, iteration: int, consumed: int, metrics: dict[str, float], at_end: bool = False,
                   split: str = "val") -> None:  # fmt: skip
        """Megatron's evaluation block; ``split`` "val" or "test" (whose TensorBoard tags say ``test``)."""
        parts = []
        kind = "validation" if split == "val" else split
        for name, value in sorted(metrics.items()):
            is_loss = name.endswith("loss")  # a perplexity only for a loss (not for an accuracy)
            ppl = math.exp(min(20.0, value)) if is_loss else None
            parts.append(f"{name} value: {value:.6E}" + (f" | {name} PPL: {ppl:.6E}" if is_loss else ""))
            if self.writer:
                self.writer.add_scalar(f"{name} {kind}", value, iteration)
                self.writer.add_scalar(f"{name} {kind} vs samples", value, consumed)
                if self.args.log_validation_ppl_to_tensorboard and is_loss:
                    self.writer.add_scalar(f"{name} {kind} ppl", ppl, iteration)
                    self.writer.add_scalar(f"{name} {kind} ppl vs samples", ppl, consumed)
        where = f"at the end of training for {split} data" if at_end else f"at iteration {iteration}"
        text = f" validation loss {where} | " + " | ".join(parts) + " |"
        self.print("-" * len(text) + "\n" + text + "\n" + "-" * len(text))

    def close(self) -> None:
        if self.writer:
            self.writer.flush()
            self.writer.close()
        sys.stdout.flush()
