"""How long a training step will take on given hardware, and where the time goes (``explain --hardware``).

The model reads what :mod:`~megatron_slapo.estimates.estimate` measured of each pipeline stage's
first rank (every operator of its forward, backward and recomputation, every collective with its
bytes, calls and the ranks of its group) and prices it with a
:class:`~megatron_slapo.estimates.hardware.Hardware` profile:

- **compute**: each GEMM at the profile's peak for its dtype times an efficiency that falls with
  its smallest dimension, ``gemm_max * d / (d + gemm_half_dim)``, times ``gemm_unaligned`` where
  a dimension is no multiple of 8 (a GPU's tensor cores then take slow paths); fused attention at
  ``efficiency.attention`` of the peak; every other operator by the bytes it reads and writes at the
  memory bandwidth (and, where a calibration measured it, ``elementwise_gelem_per_s`` for the
  arithmetic per element a CPU's exp or tanh spends); each operator pays ``op_overhead_us``. Ranks
  beyond a CPU's cores share them, as many as compute at once (a pipeline's idle share does not).
  The elementwise work of compiled modules (``--compile``'s layers) is fused: :data:`COMPILED_OTHER`
  of its time is left.
- **collectives**: ``latency x steps + bytes on the wire / bandwidth``, the ring algorithm's
  steps and bytes for the group's size, over the scale-up link when the group's ranks (the
  trainer's own rank order, read from the groups megatron-core made) share a node, else the
  scale-out link; within a node, a calibrated profile's measured seconds per call of that
  collective and group size (``collective_seconds``, interpolated at the call's size), else its
  fitted ``[latency, bandwidth]``, replaces the formula (a calibration measures one machine).
- **overlap**: the engines' data-parallel traffic hides under compute as the engine runs it
  (torch DDP's buckets and ``--overlap-grad-reduce`` under the last micro-batch's backward; FSDP's
  and ZeRO-3's gathers under the whole step, their reduce-scatters under the last backward), times
  the profile's ``communication_overlap``; tensor-, context-, expert- and pipeline-parallel
  exchanges sit on the critical path, as this code runs them.
- **pipeline**: the bubble of 1F1B, or the interleaved schedule's, ``(p - 1) / v`` micro-batch
  times of the slowest rank.
- **optimizer**: reading and writing this rank's weights, gradients and optimizer state at the
  memory bandwidth, plus the operators per tensor (a loop over tensors on a CPU, multi-tensor
  kernels on a GPU).

The step time is the slowest rank's. Model FLOPs are forward and backward without recomputation
(Megatron's count), so MFU drops when a layout recomputes.
"""

from __future__ import annotations

import argparse
import bisect
import math
from dataclasses import dataclass
from typing import Any

from megatron_slapo.estimates.estimate import RankEstimate, zero_stage
from megatron_slapo.estimates.hardware import Hardware, Link
from megatron_slapo.estimates.op_ledger import Work

# Share of the elementwise work's time left once torch.compile fuses it: fitted to the H200 runs of
# docs/benchmarks/gpu-2026-11-26 (GPT-2 124M and Llama 1B, each eager against its layers compiled)
COMPILED_OTHER = 0.2
CPU_OPS_PER_TENSOR = 12  # torch's AdamW and the norm clip, one tensor at a time, on a CPU
# collective -> (bytes on the wire per byte of payload, latency steps), for n ranks, ring algorithms
_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_single": "all_gather",
          "all_gather_into_tensor": "all_gather", "reduce_scatter": "reduce_scatter",
          "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "all_to_all": "all_to_all", "broadcast": "broadcast", "reduce": "broadcast",
          "isend": "send", "send": "send"}  # fmt: skip


def _ring(kind: str, n: int) -> tuple[float, int]:
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n, n - 1
    return 1.0, 1 if kind == "send" else max(1, math.ceil(math.log2(n)))


@dataclass
class Prediction:
    """A step on the slowest rank, in seconds, and the throughput it gives."""

    step_time_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float
    breakdown_s: dict[str, float]
    slowest_rank: int
    verdict: str
    hardware: str
    fits: bool = True
    memory_problem: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "tokens_per_s_per_device": self.tokens_per_s_per_device,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu, "breakdown_s": self.breakdown_s,
                "slowest_rank": self.slowest_rank, "verdict": self.verdict, "hardware": self.hardware,
                "fits": self.fits, "memory_problem": self.memory_problem}  # fmt: skip


def compute_time(work: Work, hw: Hardware, fused: float = 0.0) -> float:
    """Seconds of one phase's operators on one device, ``fused`` of its elementwise work in
    compiled modules (each fused to :data:`COMPILED_OTHER` of its time)."""
    e, overhead = hw.efficiency, hw.op_overhead_us * 1e-6
    seconds = 0.0
    for (dtype, dim, aligned), (calls, flops) in work.gemm.items():
        efficiency = (
            e["gemm_max"] * dim / (dim + e["gemm_half_dim"]) * (1.0 if aligned else e.get("gemm_unaligned", 1.0))
        )
        seconds += calls * overhead + flops / (hw.peak(dtype) * 1e12 * efficiency)
    for dtype, (calls, flops) in work.attention.items():
        seconds += calls * overhead + flops / (hw.peak(dtype) * 1e12 * e["attention"])
    other = work.other_calls * overhead + work.other_bytes / (hw.memory_gb_per_s * 1e9 * e["memory"])
    if hw.elementwise_gelem_per_s:
        other += work.other_elements / (hw.elementwise_gelem_per_s * 1e9)
    return seconds + other * (1 - fused * (1 - COMPILED_OTHER))


def collective_time(op: str, payload: int, calls: int, ranks: list[int], hw: Hardware, per_node: int) -> float:
    """Seconds of ``calls`` calls of collective ``op`` moving ``payload`` bytes in all (as
    ``--log-comm`` counts them) over the group of global ``ranks``."""
    kind, n = _KINDS.get(op), len(ranks)
    if kind is None or n < 2:  # a receive is the other end of a send, priced there
        return 0.0
    across = len({r // per_node for r in ranks}) > 1
    points = None if across else hw.collective_seconds.get(kind, {}).get(str(n))  # measured within a machine
    if points:  # measured call by call: the time of a call of this size, between the sizes measured
        return calls * interpolated(points, payload / max(calls, 1))
    measured = None if across else hw.collectives.get(kind, {}).get(str(n))
    if measured:
        latency_us, gb_per_s = measured
        return calls * latency_us * 1e-6 + payload / (gb_per_s * 1e9)
    link: Link = hw.scale_out if across else hw.scale_up
    wire, steps = _ring(kind, n)
    return calls * steps * link.latency_us * 1e-6 + wire * payload / (link.gb_per_s * 1e9 * hw.efficiency["link"])


def interpolated(points: list[list[float]], x: float) -> float:
    """``y`` at ``x`` on the polyline through ``points`` (``[[x, y], ...]``, ascending ``x``): below
    them the first point's ``y``, beyond them the last one's scaled with ``x`` (a call larger than
    any measured moves its bytes at no more than the largest one's bandwidth)."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1] * x / xs[-1]
    i = bisect.bisect_left(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _overlap_window(key: str, args: argparse.Namespace, zero: int | None) -> str | None:
    """Which compute the engine hides collective ``key`` under: ``"step"`` (all of it), ``"last"``
    (the last micro-batch's backward) or None (exposed)."""
    op, group = key.split("[")[0], key.split("[")[1].rstrip("]")
    if group not in ("dp", "dp-cp", "edp"):
        return None
    engine = args.engine
    gathers = op.startswith("all_gather")
    if engine == "fsdp" or (engine == "deepspeed" and zero == 3):
        return "step" if gathers else "last"
    if gathers:  # the distributed optimizer's and ZeRO-1/2's updated weights, after the step
        return None
    if engine == "ddp" or (engine == "megatron" and args.overlap_grad_reduce):
        return "last"
    return None


def _optimizer_time(e: RankEstimate, hw: Hardware) -> float:
    state = sum(v for k, v in e.memory.items() if k != "gathered")
    ops = CPU_OPS_PER_TENSOR if hw.compute_units else 1
    return (
        2 * state / (hw.memory_gb_per_s * 1e9 * hw.efficiency["memory"])
        + ops * e.weight_tensors * hw.op_overhead_us * 1e-6
    )


def _rank_breakdown(e: RankEstimate, args: argparse.Namespace, hw: Hardware, per_node: int, zero: int | None,
                    slowdown: float) -> dict[str, float]:  # fmt: skip
    forward = e.work.get("forward")  # the compiled share of the elementwise bytes (the backward's alike)
    fused = forward.fused_bytes / forward.other_bytes if forward and forward.other_bytes else 0.0
    work = {phase: compute_time(w, hw, fused) * slowdown for phase, w in e.work.items()}
    parts = {"compute": work.get("forward", 0.0) + work.get("backward", 0.0), "recompute": work.get("recompute", 0.0)}
    last_backward = work.get("backward", 0.0) / max(e.micro_batches, 1)
    for key, payload in e.comm.items():
        group = key.split("[")[1].rstrip("]")
        seconds = collective_time(
            key.split("[")[0], payload, e.calls.get(key, 1), e.groups.get(group, []), hw, per_node
        )
        window = _overlap_window(key, args, zero)
        if window is not None:
            hidden = hw.communication_overlap * (
                parts["compute"] + parts["recompute"] if window == "step" else last_backward
            )
            seconds = max(0.0, seconds - hidden)
        if seconds:
            name = f"communication[{group}]"
            parts[name] = parts.get(name, 0.0) + seconds
    parts["optimizer"] = _optimizer_time(e, hw) * slowdown
    return parts


def predict(
    estimates: list[RankEstimate], args: argparse.Namespace, hw: Hardware, world: int, per_node: int
) -> Prediction:
    """The step of ``estimates`` (each pipeline stage's first rank of a ``world``-rank run of the
    trainer's ``args``, ``per_node`` ranks to a node) on ``hw``."""
    zero = zero_stage(args, world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    # ranks sharing a CPU's cores slow each other while they compute (not while a pipeline idles)
    computing = min(world, per_node) * (1 - estimates[0].bubble)
    slowdown = max(1.0, computing / hw.compute_units) if hw.compute_units else 1.0
    per_rank = {e.rank: _rank_breakdown(e, args, hw, per_node, zero, slowdown) for e in estimates}
    busy = {rank: sum(parts.values()) for rank, parts in per_rank.items()}
    slowest = max(busy, key=busy.__getitem__)
    first = estimates[0]
    parts = dict(per_rank[slowest])
    if first.bubble:  # the pipeline's idle share, in micro-batch times of the slowest rank's work
        pipelined = busy[slowest] - parts["optimizer"]
        parts["bubble"] = pipelined * first.bubble / (1 - first.bubble)
    step = sum(parts.values())
    # model FLOPs of a device: forward and backward of each stage's work, averaged over the stages
    mean_flops = sum(sum(w.flops for p, w in e.work.items() if p != "recompute") for e in estimates) / len(estimates)
    tflops = mean_flops / step / 1e12
    tokens = args.global_batch_size * _tokens_per_sample(args)
    prediction = Prediction(
        step_time_s=step, tokens_per_s_per_device=tokens / step / world, tflops_per_device=tflops,
        mfu=tflops / hw.peak("bf16" if hw.peak_tflops.get("bf16") else "fp32"),
        breakdown_s={k: v for k, v in parts.items() if v}, slowest_rank=slowest, verdict="", hardware=hw.name,
    )  # fmt: skip
    prediction.verdict = verdict(prediction)
    fits(prediction, estimates, hw)
    return prediction


def _tokens_per_sample(args: argparse.Namespace) -> int:
    """Tokens a sample trains (an image: one)."""
    return int(getattr(args, "seq_length", None) or 1)


def fits(prediction: Prediction, estimates: list[RankEstimate], hw: Hardware) -> None:
    """Mark ``prediction`` as not fitting where a rank's peak exceeds the device's memory."""
    capacity = hw.memory_gib * 2**30
    for e in estimates:
        if e.peak > capacity:
            prediction.fits = False
            prediction.memory_problem = (f"rank {e.rank} needs {e.peak / 2**30:,.1f} GiB at its peak, more than the "
                                         f"{hw.memory_gib:g} GiB of a {hw.name} device")  # fmt: skip
            return


def verdict(p: Prediction) -> str:
    """One line: the share of compute, and the largest of what is not."""
    step = p.step_time_s
    losses = {k: v for k, v in p.breakdown_s.items() if k != "compute"}
    line = f"{p.breakdown_s.get('compute', 0.0) / step:.0%} of the step computes the model (MFU {p.mfu:.1%})"
    if losses:
        worst = max(losses, key=losses.__getitem__)
        line += f"; the largest rest is {_describe(worst)}, {losses[worst] / step:.0%}"
    return line


def _describe(part: str) -> str:
    names = {"tp": "tensor-parallel", "cp": "context-parallel", "pp": "pipeline", "dp": "data-parallel",
             "dp-cp": "data-parallel", "ep": "expert-parallel", "edp": "expert data-parallel",
             "etp": "expert tensor-parallel", "mp": "model-parallel", "embd": "tied-embedding"}  # fmt: skip
    if part.startswith("communication["):
        group = part[len("communication[") : -1]
        return f"exposed {names.get(group, group)} communication"
    return {"bubble": "the pipeline bubble", "recompute": "recomputation", "optimizer": "the optimizer step"}[part]
