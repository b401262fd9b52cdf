"""What a real training step holds and moves on this rank: the measurement ``tools/explain.py``
is tested against.

- memory: the engine's own report (weights, gradients and optimizer state as built), and the
  most weight bytes held whole at once (``gathered``: read whenever autograd saves or uses a
  tensor; a ZeRO-3 weight is empty while released, an FSDP2 layer's weights are DTensor shards
  while resharded);
- held: the bytes of the real tensors of the step, whatever any formula says (:class:`HeldBytes`):
  the engine's weights as stored on this rank, the gradients alive when the optimizer steps, and
  the optimizer's state after the step;
- logged: what the trainer itself logs after its first step (``train``'s line ``> rank R (tensor,
  pipeline, data) = ...: activations A MiB per micro-batch | peak P MiB``, read back from its output):
  the bytes autograd saves for backward per micro-batch, and the peak (on a CPU: the most saved
  bytes alive at once plus the weights, gradients and optimizer state);
- collectives: ``--log-comm``'s counts (:class:`CommLog`) over a step after the trainer's (its
  first has one-off work, such as ZeRO-3 recording the order it gathers in);
- FLOPs: ``FlopCounterMode`` over the step (forward, backward and any recomputation);
- experts: the bytes of the expert-parallel weights (an MoE model's routed experts) this rank holds.
"""

from __future__ import annotations

import contextlib
import io
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.training.loop import train
from megatron_slapo.training.run import Run, setup
from megatron_slapo.tuning.trial import step_batches


def _parameters(engine) -> list[torch.nn.Parameter]:
    """The engine's weights, each once (DeepSpeed's engine and the module it wraps share them)."""
    modules = [m for m in vars(engine).values() if isinstance(m, torch.nn.Module)]
    modules += [c for chunks in vars(engine).values() if isinstance(chunks, list)
                for c in chunks if isinstance(c, torch.nn.Module)]  # fmt: skip
    return list({id(p): p for m in modules for p in m.parameters()}.values())


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """What this rank stores of ``t``: a DTensor's local shard, a ZeRO-3 parameter's partition."""
    if t is None:
        return None
    if isinstance(t, DTensor):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def _spans(tensors) -> list[tuple[int, int]]:
    """The byte ranges ``tensors`` occupy, merged: views of one buffer, and one tensor seen twice
    (a parameter and its optimizer's view of it), count once."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors
                   if t is not None and t.numel() and t.device.type != "meta")  # fmt: skip
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _bytes(tensors) -> int:
    return sum(b - a for a, b in _spans(tensors))


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the state, inside megatron-core's and DeepSpeed's wrappers."""
    if hasattr(optimizer, "chained_optimizers"):  # megatron-core's ChainedOptimizer
        return [o for chained in optimizer.chained_optimizers for o in _torch_optimizers(chained)]
    inner = getattr(optimizer, "optimizer", None)  # megatron-core's and DeepSpeed's wrappers
    return _torch_optimizers(inner) if inner is not None and inner is not optimizer else [optimizer]


class HeldBytes:
    """Counts the real tensors of a step (see the module docstring): made before the step (it hooks
    the optimizer's step), :meth:`take` after it."""

    def __init__(self, engine) -> None:
        self.weights = _parameters(engine)
        self.optimizers = _torch_optimizers(engine.optimizer)
        self.grads: list[torch.Tensor] = []
        self.handles = [o.register_step_pre_hook(lambda *_: self._gradients()) for o in self.optimizers]

    def _gradients(self) -> None:
        """At the optimizer's step: every gradient alive (the weights' own, megatron-core's
        ``main_grad`` buffers, the gradients of the optimizer's master weights: ZeRO's partitions)."""
        params = [*self.weights, *(p for o in self.optimizers for g in o.param_groups for p in g["params"])]
        self.grads += [_local(t) for p in params for t in (p.grad, getattr(p, "main_grad", None))]

    def take(self) -> dict[str, int]:
        for handle in self.handles:
            handle.remove()
        weights = [_local(p) for p in self.weights]
        inside = _spans(weights)

        def master(p: torch.Tensor) -> bool:  # the optimizer's own copy, not a view of the weights
            start = p.data_ptr()
            return not any(a <= start < b for a, b in inside)

        state = [_local(t) for o in self.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
        masters = [_local(p) for o in self.optimizers for g in o.param_groups for p in g["params"] if master(_local(p))]
        return {"params": _bytes(weights), "grads": _bytes(self.grads), "optimizer": _bytes([*state, *masters])}


_LOGGED = re.compile(r" > rank (\d+) \(tensor, pipeline, data(?:, context)?\) = \([\d, ]+\): "
                     r"activations ([\d.]+) MiB per micro-batch \| peak ([\d.]+) MiB")  # fmt: skip


def logged_memory(run: Run) -> dict[str, float]:
    """Train ``run`` as the trainer does (``--train-iters``) and read back this rank's line of the
    memory its first step measured (rank 0 prints every rank's): bytes of activations per
    micro-batch and of the peak, to the log's precision."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            train(run)
    finally:
        destroy_num_microbatches_calculator()
    box = [{int(rank): (float(a), float(p)) for rank, a, p in _LOGGED.findall(out.getvalue())}]
    dist.broadcast_object_list(box, src=0)
    activations, peak = box[0][dist.get_rank()]
    return {"activations": activations * 2**20, "peak": peak * 2**20}


def measure(task: str, argv: list[str]) -> dict:
    """The trainer's logged memory (:func:`logged_memory`), then one more training step of
    ``pretrain_<task>.py <argv>`` on every rank, measured here; this rank's measurements."""
    run = setup(parse_args(task, argv))
    logged = logged_memory(run)
    gathered = [0]

    def held_whole() -> list[torch.nn.Parameter]:
        weights = _parameters(run.engine)  # read at each save and use: ZeRO-3 and FSDP gather
        whole = sum(p.numel() * p.element_size() for p in weights if not isinstance(p, DTensor))
        gathered[0] = max(gathered[0], whole)
        return weights

    def look(t: torch.Tensor) -> torch.Tensor:
        held_whole()  # whenever autograd saves or uses a tensor: a weight gathered for the backward counts
        return t

    with step_batches(run) as next_step:
        micro = next_step()
        held = HeldBytes(run.engine)
        log = CommLog().install()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(look, look),
                FlopCounterMode(display=False) as flops,
            ):
                run.engine.train_step(micro, run.task)
            comm = log.take()
        finally:
            log.uninstall()
    layout = run.layout
    memory = {**run.engine.memory_report(), "gathered": gathered[0]}
    experts = _bytes([p for p in _parameters(run.engine) if getattr(p, "expert_parallel", False)])
    return {"coordinates": (layout.tp_rank, layout.pp_rank, layout.dp_rank), "memory": memory, "held": held.take(),
            "logged": logged, "comm": comm, "flops": flops.get_total_flops(), "experts": experts}  # fmt: skip
