"""What a run will hold, save, move and compute on each rank, without running it (``tools/explain.py``).

:func:`estimate` plans one rank of the run in this process: the trainer's own :func:`prepare`
(the same validation, schedule, sharding, recompute and pipeline cuts) over torch's fake process
group, then the model built on the meta device, and one micro-batch through it, forward and
backward, as the engine would run it. That pass is measured, not modelled:

- activations: the bytes autograd saves for backward (saved-tensor hooks; each storage once,
  weights excluded), so recompute shows as what it really keeps;
- collectives: :class:`~megatron_slapo.parallel.comm_log.CommLog`, the counter behind
  ``--log-comm``, over the model's own collectives (the fake group's calls move nothing);
- FLOPs: ``FlopCounterMode`` (forward, backward and recomputation as they run).

A pipeline rank runs its stages as megatron-core does: each stage from the values received at its
cut, backward from the gradients sent back. What the engine adds around the model, which the meta
pass cannot run, is written from the engines' published behaviour: weight, gradient and optimizer
bytes per engine and ZeRO stage (the ZeRO paper's accounting), the data-parallel gradient and
weight collectives, the pipeline's point-to-point sends and its tied-embedding all-reduce, and
1F1B's bubble. Scalar collectives (the loss, the gradient norm) are left out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.data.samplers import data_loader
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.tracing.meta_fixes import experts_on_meta, unpacked_on_meta
from megatron_slapo.training.loop import Plan, prepare
from megatron_slapo.training.model import transformer_layers
from megatron_slapo.training.optimizer import half_precision

DEEPSPEED_MAX_LIVE = 10**9  # DeepSpeed's stage3_max_live_parameters / max_reuse_distance defaults


@dataclass
class RankEstimate:
    """One rank's share of a training step. Bytes, except ``flops``; ``comm`` is per step, keyed
    as ``--log-comm`` keys it (``all_reduce[tp]``, ``isend[pp]``, ...)."""

    rank: int
    coordinates: tuple[int, int, int]  # (tensor, pipeline, data) parallel rank
    stages: list[int]
    memory: dict[str, int]  # params, grads, optimizer
    activations: int  # saved for backward, per micro-batch
    in_flight: float  # micro-batches whose activations this rank holds at once (1F1B's warm-up)
    comm: dict[str, int]
    flops: float  # per step: forward, backward and recomputation, all micro-batches
    micro_batches: int
    bubble: float  # the pipeline's idle fraction of a step
    schedule: str = field(default="", repr=False)  # Schedule.explain() of this rank

    @property
    def peak(self) -> int:
        """Model state plus the activations held at the deepest point of the schedule."""
        return sum(self.memory.values()) + round(self.activations * self.in_flight)


class _Meter:
    """Saved bytes, collective bytes and FLOPs of a meta pass, per pipeline stage."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights  # ids of the storages of the model's weights
        self.saved: Counter[int] = Counter()
        self.comm: dict[int, Counter[str]] = {}
        self.flops: Counter[int] = Counter()
        self._stage = 0
        self._seen: set[int] = set()
        self._log = CommLog()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata  # a meta storage has no address; its StorageImpl is what views share
        if key not in self.weights and key not in self._seen:
            self._seen.add(key)
            self.saved[self._stage] += storage.nbytes()
        return t

    @contextlib.contextmanager
    def stage(self, k: int) -> Iterator[None]:
        self._stage = k
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops[k] += counter.get_total_flops()
        self.comm.setdefault(k, Counter()).update(self._log.take())

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._log.install()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._log.uninstall()


def _leaf(value: torch.Tensor) -> torch.Tensor:
    """A value received over a cut: a new leaf, as megatron-core's receive buffers are."""
    return value.detach().requires_grad_(value.is_floating_point())


def _run_stages(model: PipelineStages, plan: Plan, batch: dict, meter: _Meter) -> list[int]:
    """Forward stage by stage, each from a leaf of what crossed its cut, then backward in reverse,
    each from the gradients of what it sent. Returns the bytes that cross each cut."""
    kwargs = plan.task.inputs(batch)
    inputs = model.later_inputs(**kwargs)
    sent, received = [], []
    with meter.stage(0):
        values = model.stages[0](**kwargs)
    for k, stage in enumerate(model.stages[1:], 1):
        sent.append(values)
        received.append(tuple(_leaf(v) for v in values))
        with meter.stage(k):
            values = stage(*inputs, *received[-1])
    with meter.stage(len(model.stages) - 1):
        loss, _ = plan.task.criterion(values, batch)
        loss.backward()
    for k in reversed(range(len(sent))):
        pairs = [(out, leaf.grad) for out, leaf in zip(sent[k], received[k], strict=True) if leaf.grad is not None]
        with meter.stage(k):
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return [sum(v.numel() for v in values[:1]) for values in sent]  # megatron-core sends the first value


def _meta_pass(plan: Plan, model: torch.nn.Module, batch: dict) -> tuple[_Meter, list[int]]:
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    meter = _Meter(weights)
    with meter.installed(), unpacked_on_meta(), experts_on_meta(model):
        if isinstance(model, PipelineStages):
            return meter, _run_stages(model, plan, batch, meter)
        with meter.stage(0):
            loss, _ = plan.task.loss(model, batch)
            loss.backward()
    return meter, []


def _meta_batch(plan: Plan) -> dict:
    """The first micro-batch of this rank's data, on the meta device (only its shapes matter)."""
    args, layout = plan.args, plan.layout
    loader = data_loader(plan.datasets[0], 0, args.micro_batch_size, layout.dp_rank, args.data_parallel_size, 0)
    return {k: v.to("meta") if torch.is_tensor(v) else v for k, v in next(iter(loader)).items()}


def _state_bytes(args: argparse.Namespace, numel: int, dp: int) -> dict[str, int]:
    """Weights, gradients and optimizer state for ``numel`` model-parallel-local weights: 4 bytes
    each in fp32, and AdamW's two fp32 moments; with --bf16/--fp16, half-precision weights (on the
    engines that convert the model) plus an fp32 master copy. Sharded over ``dp`` where the engine
    shards: FSDP everything, ZeRO-1/2/3 the optimizer, from 2 the gradients, at 3 the weights,
    megatron-core's distributed optimizer the optimizer."""
    half = half_precision(args) is not None
    shard = math.ceil(numel / dp)
    if args.engine in ("ddp", "fsdp"):  # fp32 weights (autocast or FSDP's mixed-precision policy computes in half)
        count = shard if args.engine == "fsdp" else numel
        return {"params": 4 * count, "grads": 4 * count, "optimizer": 8 * count}
    if args.engine == "megatron":
        fp32_grads = (args.accumulate_allreduce_grads_in_fp32 or not args.fp16) and not args.grad_reduce_in_bf16
        optimizer = numel * 4 * (3 if half else 2)
        return {"params": numel * (2 if half else 4), "grads": numel * (4 if fp32_grads else 2),
                "optimizer": optimizer // dp if args.use_distributed_optimizer else optimizer}  # fmt: skip
    stage = args.zero_stage if args.zero_stage is not None else 1  # deepspeed
    weight = 2 if half else 4
    master = shard if stage >= 1 else numel
    return {"params": weight * (shard if stage == 3 else numel), "grads": 4 * master if stage >= 2 else weight * numel,
            "optimizer": 4 * master * (3 if stage >= 1 else 2)}  # fmt: skip


def _engine_comm(args: argparse.Namespace, numel: int, dp: int, micro: int, in_layers: int) -> Counter[str]:
    """The data-parallel collectives the engine adds around the model, per step (whole payloads:
    every rank's weights or gradients, as ``--log-comm`` counts them). ``in_layers``: how many of
    the ``numel`` weights are in transformer layers (FSDP's units)."""
    comm: Counter[str] = Counter()
    if dp == 1:
        return comm
    half = half_precision(args) is not None
    weights = numel * (2 if half and args.engine in ("megatron", "deepspeed") else 4)
    if args.engine == "ddp":
        comm["all_reduce[dp]"] += 4 * numel  # the buckets, once, after the last micro-batch
    elif args.engine == "fsdp":  # a layer is gathered for its forward and again for its backward; the
        gathered = 2 if half else 4  # root's weights (embedding, head) stay gathered from forward to backward
        comm["all_gather_single[dp]"] += micro * gathered * (2 * in_layers + numel - in_layers)
        comm["reduce_scatter_single[dp]"] += 4 * numel  # gradient sync on the last micro-batch only
    elif args.engine == "megatron":
        fp32_grads = (args.accumulate_allreduce_grads_in_fp32 or not args.fp16) and not args.grad_reduce_in_bf16
        grads = numel * (4 if fp32_grads else 2)
        if args.use_distributed_optimizer:
            comm["reduce_scatter_single[dp-cp]"] += grads
            comm["all_gather_single[dp-cp]"] += weights
        else:
            comm["all_reduce[dp-cp]"] += grads
    else:
        stage = args.zero_stage if args.zero_stage is not None else 1
        if stage == 3:  # gathered at first use; kept to the backward while all fit DeepSpeed's live limit
            gathers = 1 if numel <= DEEPSPEED_MAX_LIVE else 2
            comm["all_gather_single[dp]"] += gathers * micro * weights
            comm["reduce_scatter_single[dp]"] += micro * 4 * numel
        else:  # stage 2 reduces every micro-batch's gradients into its partition, 0/1 once a step
            comm["all_reduce[dp]"] += (micro if stage == 2 else 1) * weights
            if stage >= 1:
                comm["all_gather_single[dp]"] += weights  # the updated partitions, back to every rank
    return comm


def _tied_bytes(model: PipelineStages, local: list[int], grad_bytes: int) -> int:
    """The all-reduce that sums the first and the last stage's copies of a tied weight's gradient."""
    ends = {0, len(model.stages) - 1}
    if not ends & set(local):
        return 0
    tied = [model.stages[used[0]].get_parameter(name) for name, used in model.plan.tied.items() if set(used) >= ends]
    return sum(p.numel() for p in tied) * grad_bytes


def estimate(task: str, argv: list[str], world: int, rank: int) -> RankEstimate:
    """Plan rank ``rank`` of a ``world``-rank run of ``pretrain_<task>.py <argv>`` and measure it on meta."""
    from megatron_slapo.training.arguments import parse_args

    args = parse_args(task, argv)
    try:  # the fake group goes, whatever happens: an error is then reported as rank 0's, once
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's start-up lines: not the report
            plan = prepare(args, world, simulate_rank=rank)
        return _estimate(plan, rank)
    finally:
        parallel.destroy()


def _estimate(plan: Plan, rank: int) -> RankEstimate:
    args, layout = plan.args, plan.layout
    text = plan.sch.explain()
    model = ms.build(plan.sch, init_weights=False, device="meta", recompute_pipeline_inputs=True)
    dp, pp = args.data_parallel_size, layout.pp_size
    micro = args.global_batch_size // (args.micro_batch_size * dp)
    local = [k for k in range(plan.stages) if k % pp == layout.pp_rank]
    modules = [s for k, s in model.local(layout.pp_rank, pp)] if isinstance(model, PipelineStages) else [model]
    numel = sum({id(p): p.numel() for m in modules for p in m.parameters()}.values())  # a tied weight once
    meter, crossing = _meta_pass(plan, model, _meta_batch(plan))
    comm: Counter[str] = Counter()
    for k in local:
        comm.update({key: micro * value for key, value in meter.comm.get(k, {}).items()})
    layers = transformer_layers(model, plan.config.num_hidden_layers) if args.engine == "fsdp" else []
    in_layers = sum(p.numel() for path in layers for p in model.get_submodule(path).parameters())
    comm.update(_engine_comm(args, numel, dp, micro, in_layers))
    unique = {id(p): p for m in modules for p in m.parameters()}.values()
    partial = sum(p.numel() for p in unique if getattr(p, "sequence_parallel", False))
    if partial and layout.tp_size > 1:  # sequence parallelism's replicated weights: partial gradients, summed
        comm["all_reduce[tp]"] += 4 * partial * (micro if args.engine == "deepspeed" else 1)  # ZeRO: in backward
    activations = sum(meter.saved[k] for k in local)
    in_flight, bubble = 1, 0.0
    if isinstance(model, PipelineStages):
        half = half_precision(args) is not None
        value_bytes = 2 if half else 4
        for k in local:
            if k > 0:  # receive the activation, send its gradient back
                comm["irecv[pp]"] += micro * crossing[k - 1] * value_bytes
                comm["isend[pp]"] += micro * crossing[k - 1] * value_bytes
            if k < plan.stages - 1:
                comm["isend[pp]"] += micro * crossing[k] * value_bytes
                comm["irecv[pp]"] += micro * crossing[k] * value_bytes
        fp32_grads = not args.fp16 or args.accumulate_allreduce_grads_in_fp32
        tied = _tied_bytes(model, local, 4 if fp32_grads and not args.grad_reduce_in_bf16 else 2)
        if tied:
            comm["all_reduce[embd]"] += tied
        chunks = len(local)  # virtual stages per rank
        if chunks == 1:  # 1F1B: the warm-up forwards, then one more before the first backward
            in_flight = min(micro, pp - layout.pp_rank)
        else:  # interleaved: megatron-core's warm-up count, in chunk forwards (a chunk holds 1/chunks of it)
            in_flight = min(micro * chunks, (pp - layout.pp_rank - 1) * 2 + (chunks - 1) * pp + 1) / chunks
        bubble = (pp - 1) / (chunks * micro + pp - 1)
    return RankEstimate(
        rank=rank, coordinates=(layout.tp_rank, layout.pp_rank, layout.dp_rank), stages=local,
        memory=_state_bytes(args, numel, dp), activations=activations, in_flight=in_flight,
        comm=dict(sorted(comm.items())), flops=micro * sum(meter.flops[k] for k in local), micro_batches=micro,
        bubble=bubble, schedule=text,
    )  # fmt: skip
