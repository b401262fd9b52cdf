"""The meta pass behind explain: one micro-batch forward and backward on meta tensors, measured.

:func:`meta_pass` runs the model :func:`~megatron_slapo.estimates.estimate.estimate` built (a
pipeline rank's stages as megatron-core runs them: each from a leaf of what crossed its cut,
backward from the gradients it receives) under a :class:`Meter`: saved-tensor hooks (activation
bytes), :class:`~megatron_slapo.parallel.comm_log.CommLog` (collectives and their calls),
``FlopCounterMode`` and the time model's :class:`~megatron_slapo.estimates.op_ledger.OpLedger`,
each per pipeline stage.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_slapo.compat.torch_internals import storage_key
from megatron_slapo.compat.transformers_internals import unpacked_on_meta
from megatron_slapo.data.samplers import data_loader
from megatron_slapo.estimates.context_estimate import counting_exchanges
from megatron_slapo.estimates.kernel_attention import attention_kernel
from megatron_slapo.estimates.op_ledger import OpLedger
from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.pipeline import PipelineStages
from megatron_slapo.tracing.meta_fixes import experts_on_meta
from megatron_slapo.training.plan import Plan


class Meter:
    """Saved bytes, collective bytes and FLOPs of a meta pass, per pipeline stage."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights  # ids of the storages of the model's weights
        self.saved: Counter[int] = Counter()
        self.comm: dict[int, Counter[str]] = {}
        self.flops: Counter[int] = Counter()
        self._stage = 0
        self._seen: set[int] = set()
        self._log = CommLog()
        self.metrics = 0  # how many metrics the loss reports (each averaged over the ranks as an fp32)
        self.ledger = OpLedger()  # every operator's work, for the time model
        self.calls: dict[int, Counter[str]] = {}

    def count(self, comm: Counter[str]) -> None:
        """Collectives counted without being called (the context-parallel ring's, on meta): the
        current stage's, as if called."""
        self.comm.setdefault(self._stage, Counter()).update(comm)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage_key(storage)  # a meta storage has no address; its StorageImpl is what views share
        if key not in self.weights and key not in self._seen:
            self._seen.add(key)
            self.saved[self._stage] += storage.nbytes()
        return t

    @contextlib.contextmanager
    def stage(self, k: int) -> Iterator[None]:
        self._stage = self.ledger.stage = k
        with FlopCounterMode(display=False) as counter:
            yield
        self.flops[k] += counter.get_total_flops()
        self.calls.setdefault(k, Counter()).update(self._log.take_calls())
        self.comm.setdefault(k, Counter()).update(self._log.take())

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Autograd's backward: its operators are filed as backward (or recompute) work."""
        self.ledger.backward = True
        try:
            yield
        finally:
            self.ledger.backward = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._log.install()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), self.ledger:
                yield
        finally:
            self._log.uninstall()


def _leaf(value: torch.Tensor) -> torch.Tensor:
    """A value received over a cut: a new leaf in a buffer of its own, as megatron-core's receive
    buffers are (a stage that saves it must count it, even where the sender saved it too)."""
    return value.detach().clone().requires_grad_(value.is_floating_point())


def _run_stages(model: PipelineStages, plan: Plan, batch: dict, meter: Meter) -> list[int]:
    """Forward stage by stage, each from a leaf of what crossed its cut, then backward in reverse,
    each from the gradients of what it sent. Returns the elements megatron-core sends over each cut."""
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
        loss, metrics = plan.task.criterion(values, batch)
        meter.metrics = len(metrics)
        with meter.backward():
            loss.backward()
    for k in reversed(range(len(sent))):
        pairs = [(out, leaf.grad) for out, leaf in zip(sent[k], received[k], strict=True) if leaf.grad is not None]
        with meter.stage(k), meter.backward():
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return [sum(v.numel() for v in values[:1]) for values in sent]  # megatron-core sends the first value


def meta_pass(plan: Plan, model: torch.nn.Module, batch: dict, attention: str | None) -> tuple[Meter, list[int]]:
    weights = {storage_key(p.untyped_storage()) for p in model.parameters()}
    meter = Meter(weights)
    compiled = [node.mod for _, node in plan.sch.named_schedules() if node.metadata.compiled]
    with (meter.installed(), unpacked_on_meta(), experts_on_meta(model), counting_exchanges(meter.count),
          attention_kernel(attention), meter.ledger.fusing(compiled)):  # fmt: skip
        if isinstance(model, PipelineStages):
            return meter, _run_stages(model, plan, batch, meter)
        with meter.stage(0):
            loss, metrics = plan.task.loss(model, batch)
            meter.metrics = len(metrics)
            with meter.backward():
                loss.backward()
    return meter, []


def meta_batch(plan: Plan) -> dict:
    """The first micro-batch of this rank's data, on the meta device (only its shapes matter)."""
    args, layout = plan.args, plan.layout
    loader = data_loader(plan.datasets[0], 0, args.micro_batch_size, layout.data_rank, args.data_parallel_size, 0)
    return {k: v.to("meta") if torch.is_tensor(v) else v for k, v in next(iter(loader)).items()}
