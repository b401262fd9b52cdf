"""What a run will hold, save, move and compute on each rank, without running it (``tools/explain.py``).

:func:`estimate` plans one rank of the run in this process: the trainer's own :func:`prepare`
(the same validation, schedule, sharding, recompute and pipeline cuts) over torch's fake process
group, then the model built on the meta device, and one micro-batch through it, forward and
backward, as the engine would run it (:mod:`~megatron_slapo.estimates.meta_pass`). That pass
is measured, not modelled:

- activations: the bytes autograd saves for backward (saved-tensor hooks; each storage once,
  weights excluded), so recompute shows as what it really keeps; the attention's as SDPA keeps
  them on meta (its math path's score matrices), or as a GPU's flash kernel does
  (``attention="flash"``: :mod:`~megatron_slapo.estimates.kernel_attention`);
- collectives: :class:`~megatron_slapo.parallel.comm_log.CommLog`, the counter behind
  ``--log-comm``, over the model's own collectives (the fake group's calls move nothing); the
  context-parallel ring's, which makes none on meta, from each of its runs
  (:mod:`~megatron_slapo.estimates.context_estimate`);
- FLOPs: ``FlopCounterMode`` (forward, backward and recomputation as they run).

A pipeline rank runs its stages as megatron-core does: each stage from the values received at its
cut, backward from the gradients sent back. What the engine adds around the model, which the meta
pass cannot run, is written from the engines' published behaviour: weight, gradient and optimizer
bytes per engine and ZeRO stage (the ZeRO paper's accounting), the data-parallel gradient and
weight collectives, the pipeline's point-to-point sends and its tied-embedding all-reduce, and
1F1B's bubble, and the scalar collectives a step logs: megatron-core's gradient norm (summed over its
gradient-statistics group: ``all_reduce[mp]``, the model-parallel ranks), the metrics averaged over
the data-parallel ranks and, through a pipeline, sent to every stage. Left out: the other engines'
norm reductions (a few bytes beside their gradients'), their communication buckets (DeepSpeed's
ZeRO-1/2 reduce bucket, say) and allocator slack.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.engines.base import adamw_state
from megatron_slapo.engines.deepspeed_zero import deepspeed_config, zero_state
from megatron_slapo.engines.megatron_memory import megatron_state
from megatron_slapo.engines.optimizer import half_precision, megatron_fp32_grads
from megatron_slapo.estimates.context_estimate import replicas_group, weight_replicas
from megatron_slapo.estimates.expert_estimate import (
    ExpertShare,
    RoutedTraffic,
    expert_gradient_comm,
    expert_share,
    is_expert,
)
from megatron_slapo.estimates.meta_pass import Meter, meta_batch, meta_pass
from megatron_slapo.estimates.op_ledger import Work
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.parallel.comm_log import group_names
from megatron_slapo.parallel.state import Layout
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.training.plan import Plan, prepare, start_groups, take_checkpoint_args

DEEPSPEED_MAX_LIVE = 10**9  # DeepSpeed's stage3_max_live_parameters / max_reuse_distance defaults
DEEPSPEED_PERSISTENT = 10**5  # its stage3_param_persistence_threshold default


@dataclass
class RankEstimate:
    """One rank's share of a training step. Bytes, except ``flops``; ``comm`` is per step, keyed
    as ``--log-comm`` keys it (``all_reduce[tp]``, ``isend[pp]``, ...)."""

    rank: int
    coordinates: tuple[int, ...]  # (tensor, pipeline, data[, context]) parallel rank: Layout.coordinates()
    stages: list[int]
    memory: dict[str, int]  # params, grads, optimizer
    activations: int  # saved for backward, per micro-batch
    in_flight: float  # micro-batches whose activations this rank holds at once (1F1B's warm-up)
    comm: dict[str, int]
    flops: float  # per step: forward, backward and recomputation, all micro-batches
    micro_batches: int
    bubble: float  # the pipeline's idle fraction of a step
    schedule: str = field(default="", repr=False)  # Schedule.explain() of this rank
    work: dict[str, Work] = field(default_factory=dict, repr=False)  # per step, by phase: the time model's
    calls: dict[str, int] = field(default_factory=dict)  # per step: how many times each collective is called
    groups: dict[str, list[int]] = field(default_factory=dict)  # the global ranks of each group it talks over
    weight_tensors: int = 0  # the tensors its optimizer steps
    experts: ExpertShare | None = None  # its routed experts, under expert parallelism
    context_parallel: int = 1  # the ranks each sequence is split across (this one runs 1/C of its tokens)

    @property
    def peak(self) -> int:
        """Model state plus the activations held at the deepest point of the schedule."""
        return sum(self.memory.values()) + round(self.activations * self.in_flight)


@dataclass
class _Weights:
    """This rank's weights as the engine sees them: element counts, a tied weight once."""

    sizes: list[int]  # per weight tensor
    in_layers: int  # elements inside transformer layers (FSDP's units)
    largest_layer: int
    partial: int  # elements of sequence parallelism's replicated weights (partial gradients)
    experts: int = 0  # elements of expert-parallel weights (reduced over the expert-data-parallel ranks)

    @property
    def numel(self) -> int:
        return sum(self.sizes)


def zero_stage(args: argparse.Namespace, dp: int) -> int | None:
    """DeepSpeed's ZeRO stage (``--zero-stage``, or the ``--deepspeed-config``'s; default 1), or
    None on another engine."""
    if args.engine != "deepspeed":
        return None
    return deepspeed_config(args, dp)["zero_optimization"]["stage"]


def _weight_bytes(args: argparse.Namespace) -> int:
    """Bytes of a weight as it is stored: half precision where the engine converts the model."""
    return 2 if half_precision(args) is not None and args.engine in ("megatron", "deepspeed") else 4


def _grad_bytes(args: argparse.Namespace) -> int:
    """Bytes of a gradient as it is reduced."""
    if args.engine == "megatron":
        return 4 if megatron_fp32_grads(args) else 2
    return _weight_bytes(args)  # DeepSpeed reduces in the model's dtype; DDP and FSDP in fp32


def _state_bytes(args: argparse.Namespace, w: _Weights, dp: int, stage: int | None, edp: int) -> dict[str, int]:
    """Weights, gradients and optimizer state, counted by each engine's own accounting (the one its
    memory report uses) for this rank's share of ``w``, of which ``dp`` ranks hold copies (the
    data-parallel x context-parallel ranks): FSDP shards everything over them, ZeRO
    from the optimizer (1) to the weights (3), megatron-core's distributed optimizer the optimizer.
    ``gathered``: whole weights held while they are used (FSDP's root and two layers, the current
    and the prefetched; ZeRO-3's, kept from forward to backward). Expert-parallel weights' state is
    sharded over the ``edp`` expert-data-parallel ranks instead (megatron-core's expert optimizer)."""
    numel, shard = w.numel, math.ceil(w.numel / dp)
    if args.engine == "ddp":
        return adamw_state(4 * numel)
    if args.engine == "fsdp":  # fp32 shards, gathered in the compute dtype
        gathered = (numel - w.in_layers + 2 * w.largest_layer) * (2 if half_precision(args) else 4) if dp > 1 else 0
        return {**adamw_state(4 * shard), "gathered": gathered}
    if args.engine == "megatron":
        dense, experts = megatron_state(args, numel - w.experts, dp), megatron_state(args, w.experts, edp)
        return {key: dense[key] + experts[key] for key in dense}
    weight = _weight_bytes(args)
    local = weight * (shard if stage == 3 else numel)
    state = zero_state(stage, local, weight * numel, shard if stage else numel, half_precision(args) is not None)
    if stage == 3 and dp > 1:
        state["gathered"] = weight * min(numel, DEEPSPEED_MAX_LIVE)
    return state


def _engine_comm(args: argparse.Namespace, w: _Weights, dp: int, micro: int, stage: int | None,
                 edp: int) -> Counter[str]:  # fmt: skip
    """The collectives the engine adds around the model, per step (whole payloads: every rank's
    weights or gradients, as ``--log-comm`` counts them): the data-parallel ones (expert-parallel
    weights' over the ``edp`` expert-data-parallel ranks), and the sum of sequence parallelism's
    partial gradients over the tensor-parallel ranks."""
    comm = _data_parallel_comm(args, w, dp, micro, stage)
    comm.update(expert_gradient_comm(args, w.experts, edp, _weight_bytes(args), _grad_bytes(args)))
    if w.partial and args.tensor_model_parallel_size > 1:
        shards = dp if args.engine == "fsdp" else 1  # FSDP sums each rank's shard
        times = micro if args.engine == "deepspeed" else 1  # ZeRO: in its backward hooks
        comm["all_reduce[tp]"] += times * math.ceil(w.partial / shards) * _grad_bytes(args)
    return comm


def _data_parallel_comm(args: argparse.Namespace, w: _Weights, dp: int, micro: int, stage: int | None) -> Counter[str]:
    comm: Counter[str] = Counter()
    if dp == 1:
        return comm
    group = replicas_group(args)  # the trainer's group of the weights' copies (megatron-core's DDP: its own)
    numel = w.numel - w.experts  # expert-parallel weights: over their own group (expert_gradient_comm)
    weights, grads = numel * _weight_bytes(args), numel * _grad_bytes(args)
    if args.engine == "ddp":
        comm[f"all_reduce[{group}]"] += grads  # the buckets, once, after the last micro-batch
    elif args.engine == "fsdp":  # a layer is gathered for its forward and again for its backward; the
        gathered = 2 if half_precision(args) is not None else 4  # root's weights stay from forward to backward
        comm[f"all_gather_single[{group}]"] += micro * gathered * (numel + w.in_layers)
        comm[f"reduce_scatter_single[{group}]"] += grads  # gradient sync on the last micro-batch only
    elif args.engine == "megatron":
        if args.use_distributed_optimizer:
            comm["reduce_scatter_single[dp-cp]"] += grads
            comm["all_gather_single[dp-cp]"] += weights
        else:
            comm["all_reduce[dp-cp]"] += grads
    elif stage == 3:
        # A weight is gathered at its first use in each micro-batch and kept to its backward while
        # all fit DeepSpeed's live limit (else gathered again for the backward); weights of at most
        # DEEPSPEED_PERSISTENT elements stay whole between micro-batches and are gathered once a step.
        large = sum(n for n in w.sizes if n > DEEPSPEED_PERSISTENT)
        gathers = 1 if numel <= DEEPSPEED_MAX_LIVE else 2
        comm[f"all_gather_single[{group}]"] += (gathers * micro * large + numel - large) * _weight_bytes(args)
        comm[f"reduce_scatter_single[{group}]"] += micro * grads
    else:  # stage 2 reduces every micro-batch's gradients into its partition, 0/1 once a step
        comm[f"all_reduce[{group}]"] += (micro if stage == 2 else 1) * grads
        if stage >= 1:
            comm[f"all_gather_single[{group}]"] += weights  # the updated partitions, back to every rank
    return comm


def _scalar_comm(args: argparse.Namespace, metrics: int, last_stage: bool, pp: int, dp: int) -> Counter[str]:
    """A step's scalar collectives, fp32 each, keyed as ``--log-comm`` keys them: megatron-core's
    gradient norm, summed over its gradient-statistics group (the model-parallel ranks, ``[mp]``;
    every rank of the instance with the distributed optimizer), and the ``metrics`` averaged over the
    ``dp`` data-parallel (x context-parallel) ranks (megatron-core's engine: on the last stage, then
    broadcast to every stage)."""
    from megatron.core import parallel_state as ps

    comm: Counter[str] = Counter()
    names = group_names()
    if args.engine == "megatron":
        group = (ps.get_intra_distributed_optimizer_instance_group() if args.use_distributed_optimizer
                 else ps.get_model_parallel_group())  # fmt: skip
        if dist.get_world_size(group) > 1:
            comm[f"all_reduce[{names.get(group, 'other')}]"] += 4  # "other": CommLog's name for a group it has none for
        if pp > 1:
            comm["broadcast[pp]"] += 4 * metrics
    if dp > 1 and (last_stage or args.engine != "megatron"):
        comm[f"all_reduce[{replicas_group(args)}]"] += 4 * metrics
    return comm


def _tied_bytes(model: PipelineStages, local: list[int], grad_bytes: int) -> int:
    """The all-reduce that sums the first and the last stage's copies of a tied weight's gradient."""
    ends = {0, len(model.stages) - 1}
    if not ends & set(local):
        return 0
    tied = [model.stages[used[0]].get_parameter(name) for name, used in model.plan.tied.items() if set(used) >= ends]
    return sum(p.numel() for p in tied) * grad_bytes


def micro_batches_in_flight(micro: int, pp: int, pp_rank: int, chunks: int) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once, each of its
    ``chunks`` virtual stages counting for ``1/chunks`` of one."""
    if chunks == 1:  # 1F1B: the warm-up forwards, then one more before the first backward
        return min(micro, pp - pp_rank)
    # interleaved: megatron-core's warm-up count, in chunk forwards
    return min(micro * chunks, (pp - pp_rank - 1) * 2 + (chunks - 1) * pp + 1) / chunks


@dataclass
class _Measured:
    """A plan built on meta and measured by one pass, which runs every stage whatever the rank:
    what ranks in the same place but for their pipeline rank share (:func:`estimate`)."""

    key: tuple  # estimate()'s (task, argv, world, attention)
    place: tuple[int, ...]  # _place() of the rank planned
    plan: Plan
    model: torch.nn.Module
    meter: Meter
    crossing: list[int]  # _run_stages()'
    traffic: RoutedTraffic
    schedule: str  # Schedule.explain(), before the build


PLANS_KEPT = 3  # plans kept for the next ranks of the same runs (the tuner's shallow pairs: layer_extrapolation)
_plans: dict[tuple, _Measured] = {}  # estimate()'s key -> its plan, the last used last
# flags (with how many values each takes) that choose only how the engine keeps the weights' state:
# Megatron's distributed optimizer, DeepSpeed's ZeRO stages. The model and its pass are the same.
STATE_FLAGS = {"--use-distributed-optimizer": 0, "--zero-stage": 1, "--engine": 1}
STATE_ENGINES = ("megatron", "deepspeed")


def model_argv(argv: list[str]) -> tuple[str, ...]:
    """``argv`` without :data:`STATE_FLAGS` (an ``--engine`` only where it names one of
    :data:`STATE_ENGINES`): what the model, its schedule and its meta pass depend on."""
    out, i = [], 0
    while i < len(argv):
        flag, equals, inline = argv[i].partition("=")
        width = STATE_FLAGS.get(flag)
        value = inline if equals else (argv[i + 1] if width and i + 1 < len(argv) else "")
        if width is None or (flag == "--engine" and value not in STATE_ENGINES):
            out.append(argv[i])
            i += 1
        else:
            i += 1 if equals else 1 + width
    return tuple(out)


def _place() -> tuple[int, ...]:
    """This rank's place but for its pipeline rank: what decides its shards and its micro-batch."""
    from megatron.core import parallel_state as ps

    layout = Layout.current()
    return (layout.tp_rank, layout.dp_rank, layout.cp_rank, layout.data_rank, ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank())  # fmt: skip


def estimate(task: str, argv: list[str], world: int, rank: int, attention: str | None = None) -> RankEstimate:
    """Plan rank ``rank`` of a ``world``-rank run of ``pretrain_<task>.py <argv>`` and measure it on meta.

    ``attention``: ``"flash"`` runs the attention as a GPU's fused kernel does, which keeps no score
    matrices (:mod:`~megatron_slapo.estimates.kernel_attention`); None, as SDPA runs on meta (its math
    path, which keeps them).

    Ranks that differ only in their pipeline rank build the same model, and the meta pass runs every
    stage of it: asked for one after another (explain asks for each stage's first rank), the later
    ranks read their own stages of a kept plan and pass (:data:`PLANS_KEPT`), not made again. So do
    runs that differ only in :data:`STATE_FLAGS` (the tuner's ZeRO stages): each is validated, and
    its engine's bytes and collectives counted, as its own."""
    from megatron_slapo.arguments.parser import parse_args

    key = (task, model_argv(argv), world, attention)
    args = parse_args(task, argv)
    try:  # the fake group goes, whatever happens (an error is then reported as a plain process's)
        measured = _plans.pop(key, None)
        if measured is not None:
            take_checkpoint_args(args)  # as prepare() checks a run before planning it
            validate_args(args, world)
            start_groups(measured.plan.args, world, rank)  # as the plan laid it out, at this rank
        if measured is None or _place() != measured.place:
            measured = None  # the last model goes before the next is built
            with contextlib.redirect_stdout(io.StringIO()):  # the trainer's start-up lines: not the report
                plan = prepare(args, world, simulate_rank=rank)
            measured = _measure(plan, key, attention)
        _plans[key] = measured
        while len(_plans) > PLANS_KEPT:
            _plans.pop(next(iter(_plans)))
        return _estimate(measured, Layout.current(), rank, args)
    finally:
        parallel.destroy()


def _measure(plan: Plan, key: tuple, attention: str | None) -> _Measured:
    """Build ``plan``'s model on meta and run its pass."""
    text = plan.sch.explain()
    model = ms.build(plan.sch, init_weights=False, device="meta", recompute_pipeline_inputs=True)
    if half := half_precision(plan.args):  # megatron-core and DeepSpeed convert the model, FSDP gathers it so;
        model.to(half)  # DDP's autocast keeps some activations in fp32, which this pass does not
    with RoutedTraffic(model, plan.args.moe_token_dispatcher_type) as traffic:
        meter, crossing = meta_pass(plan, model, meta_batch(plan), attention)
    return _Measured(key, _place(), plan, model, meter, crossing, traffic, text)


def _estimate(measured: _Measured, layout: Layout, rank: int, args: argparse.Namespace) -> RankEstimate:
    """Rank ``rank``'s estimate (of ``layout``'s place) from its stages of ``measured``, for a run
    of ``args`` (which may differ from the plan's in :data:`STATE_FLAGS`)."""
    plan, model, meter, crossing = measured.plan, measured.model, measured.meter, measured.crossing
    half, text = half_precision(args), measured.schedule
    dp, pp = args.data_parallel_size, layout.pp_size
    micro = args.global_batch_size // (args.micro_batch_size * dp)
    copies = weight_replicas(args)  # the data-parallel ranks, times the context-parallel ones: the weights' copies
    local = [k for k in range(plan.stages) if k % pp == layout.pp_rank]
    modules = [s for k, s in model.local(layout.pp_rank, pp)] if isinstance(model, PipelineStages) else [model]
    unique = list({id(p): p for m in modules for p in m.parameters()}.values())  # a tied weight once
    layers = transformer_layers(model, plan.config.num_hidden_layers) if args.engine == "fsdp" else []
    per_layer = [sum(p.numel() for p in model.get_submodule(path).parameters()) for path in layers]
    weights = _Weights([p.numel() for p in unique], sum(per_layer), max(per_layer, default=0),
                       sum(p.numel() for p in unique if getattr(p, "sequence_parallel", False)),
                       sum(p.numel() for p in unique if is_expert(p)))  # fmt: skip
    experts = expert_share((node for _, node in plan.sch.named_schedules()), unique, _weight_bytes(args))
    edp = experts.expert_data_parallel if experts else copies
    # the tokens' exchange: counted from what reached the experts, in place of the meta pass's (its routing is a guess)
    routed = measured.traffic.per_micro_batch(modules)
    comm: Counter[str] = Counter({key: micro * value for key, value in routed.items()})
    for k in local:
        comm.update({key: micro * value for key, value in meter.comm.get(k, {}).items() if key not in routed})
    stage = zero_stage(args, dp)  # reads --deepspeed-config: once
    comm.update(_engine_comm(args, weights, copies, micro, stage, edp))
    comm.update(_scalar_comm(args, meter.metrics, plan.stages - 1 in local, pp, copies))
    activations = sum(meter.saved[k] for k in local)
    in_flight, bubble = 1, 0.0
    if isinstance(model, PipelineStages):
        value_bytes = 2 if half else 4
        for k in local:
            if k > 0:  # receive the activation, send its gradient back
                comm["irecv[pp]"] += micro * crossing[k - 1] * value_bytes
                comm["isend[pp]"] += micro * crossing[k - 1] * value_bytes
            if k < plan.stages - 1:
                comm["isend[pp]"] += micro * crossing[k] * value_bytes
                comm["irecv[pp]"] += micro * crossing[k] * value_bytes
        tied = _tied_bytes(model, local, _grad_bytes(args))
        if tied:
            comm["all_reduce[embd]"] += tied
        chunks = len(local)  # virtual stages per rank
        in_flight = micro_batches_in_flight(micro, pp, layout.pp_rank, chunks)
        bubble = (pp - 1) / (chunks * micro + pp - 1)
    calls: Counter[str] = Counter()
    for k in local:
        calls.update({key: micro * value for key, value in meter.calls.get(k, {}).items()})
    return RankEstimate(
        rank=rank, coordinates=layout.coordinates()[1], stages=local,
        memory=_state_bytes(args, weights, copies, stage, edp), activations=activations, in_flight=in_flight,
        comm=dict(sorted(comm.items())), flops=micro * sum(meter.flops[k] for k in local), micro_batches=micro,
        bubble=bubble, schedule=text, experts=experts, context_parallel=args.context_parallel_size,
        work=meter.ledger.phases(local, micro), calls={key: calls.get(key, 1) for key in comm},
        groups=_group_ranks(), weight_tensors=len(unique),
    )  # fmt: skip


def _group_ranks() -> dict[str, list[int]]:
    """The global ranks of each of this rank's named groups (megatron-core's rank order, which the
    time model reads to tell a group inside a node from one across nodes)."""
    return {name: dist.get_process_group_ranks(group) for group, name in group_names().items()}
