"""``Verify``: check a schedule against the model it rewrites, outputs *and* gradients.

::

    with Verify(sch, [input_ids]):
        sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)
        ...

On entry the unscheduled model is copied; on a clean exit both are built with the same seed (so
they start from identical full weights), run on the same inputs (broadcast from rank 0 of the
schedule's group), and compared: every output tensor (a tensor-parallel output partitioned along
one dim is gathered first), then, after one backward pass, every parameter gradient (shards are
gathered and reassembled). All ranks agree on the verdict; a mismatch raises
:class:`VerificationError` naming the worst offenders. Slapo's Verify checked only the forward.

A parameter that a primitive renamed is compared too when its module says where it came from
(``param_origins()``, e.g. a fused q|k|v projection: the concatenation of the original layers'
gradients). Any parameter left without a counterpart is listed in ``report.unchecked`` with the
reason, and an :class:`UncheckedGradientsWarning` names them: nothing is skipped silently.

Dropout makes runs incomparable: verify in ``eval()`` mode or with dropout probabilities of 0.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.build import agreed_seed, build
from megatron_slapo.metadata import Metadata
from megatron_slapo.parallel.collectives import (
    Group,
    all_gather,
    allreduce_sequence_parallel_grads,
    comm_device,
    gather_tensor,
    group_size,
)
from megatron_slapo.parallel.layout import unshard
from megatron_slapo.schedule import Schedule


class VerificationError(AssertionError):
    """The scheduled model does not reproduce the original."""


class UncheckedGradientsWarning(UserWarning):
    """Verify could not compare some parameters' gradients (listed, with the reason)."""


@dataclass
class VerifyReport:
    """Largest absolute difference per compared output and gradient."""

    outputs: dict[str, float] = field(default_factory=dict)
    grads: dict[str, float] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)  # parameter -> why its gradient was not compared
    failures: list[str] = field(default_factory=list)

    @property
    def skipped(self) -> list[str]:
        """The parameters whose gradients were not compared (see ``unchecked`` for why)."""
        return list(self.unchecked)


class Verify:
    """Context manager that verifies the primitives applied inside it (see module docstring)."""

    def __init__(
        self,
        sch: Schedule,
        example_inputs: Sequence[Any] | torch.Tensor,
        example_kwargs: dict[str, Any] | None = None,
        *,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        seed: int | None = None,
        atol: float = 1e-5,
        rtol: float = 1e-5,
        check_grads: bool = True,
    ) -> None:
        self.sch = sch
        self.args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        self.kwargs = dict(example_kwargs or {})
        self.loss_fn, self.seed, self.atol, self.rtol, self.check_grads = (
            loss_fn,
            seed,
            atol,
            rtol,
            check_grads,
        )
        self.report: VerifyReport | None = None

    def __enter__(self) -> Verify:
        scheduled = [path or "<root>" for path, node in self.sch.named_schedules() if node.metadata != Metadata()]
        if scheduled:
            raise VerificationError(
                f"Verify must wrap the whole schedule, but {', '.join(scheduled[:3])} already has primitives applied"
            )
        self.reference = copy.deepcopy(self.sch.mod)
        # Where each module was before scheduling (held, so that ids stay valid): renamed
        # parameters are traced back through their modules' param_origins().
        self.original_modules = dict(self.sch.mod.named_modules(remove_duplicate=False))
        self.original_paths = {id(m): path for path, m in self.original_modules.items()}
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self.report = self.run()
        finally:
            self.original_modules = self.original_paths = {}  # let replaced modules (and weights) go
        return False

    def run(self) -> VerifyReport:
        seed = agreed_seed(self.seed)
        model = build(self.sch, seed=seed)
        reference = build(Schedule(self.reference), seed=seed)  # no group: the single-device model
        reference.train(model.training)
        group = self.sch.group
        args, kwargs = _broadcast((self.args, self.kwargs), group)
        device = next(model.parameters()).device
        args, kwargs = _to(args, device), _to(kwargs, device)
        report = VerifyReport()

        out = model(*args, **kwargs)
        ref_out = reference(*_clone(args), **_clone(kwargs))
        pairs = _paired_outputs(out, ref_out, group, report)
        for name, (mine, ref) in pairs.items():
            self._compare(report, report.outputs, name, mine.detach(), ref.detach())
        if self.check_grads:
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            if self.loss_fn is not None:
                loss, ref_loss = self.loss_fn(out), self.loss_fn(ref_out)
            else:
                loss, ref_loss = _probe_losses(pairs)
            (loss + ref_loss).backward()  # disjoint graphs: one call fills both models' grads
            allreduce_sequence_parallel_grads(model, group)
            self._compare_grads(report, model, reference, group)

        failed = torch.tensor([1.0 if report.failures else 0.0], device=comm_device(group))
        if group_size(group) > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if failed.item():
            detail = "; ".join(report.failures[:5]) or "mismatches were found on another rank"
            raise VerificationError(f"scheduled model differs from the original: {detail}")
        return report

    def _compare(self, report: VerifyReport, table: dict, name: str, mine: torch.Tensor, ref: torch.Tensor) -> None:
        if mine.shape != ref.shape:
            report.failures.append(f"{name}: shape {tuple(mine.shape)} vs {tuple(ref.shape)}")
            return
        diff = (mine.float() - ref.float()).abs().max().item() if mine.numel() else 0.0
        table[name] = diff
        if not diff <= self.atol + self.rtol * ref.float().abs().max().item():
            report.failures.append(f"{name}: max abs diff {diff:.3g}")

    def _compare_grads(self, report: VerifyReport, model: nn.Module, reference: nn.Module, group: Group) -> None:
        ref_params = dict(reference.named_parameters())
        origins = self._origins(model)
        for name, p in model.named_parameters():
            ref_grad = self._reference_grad(name, ref_params, origins, report)
            if ref_grad is False:
                continue
            grad = p.grad
            if grad is not None and getattr(p, "tensor_model_parallel", False) and group_size(group) > 1:
                parts = gather_tensor(grad.unsqueeze(0), 0, group).unbind(0)
                grad = unshard(parts, p.partition_dim, p.partition_stride)
            if (grad is None) != (ref_grad is None):
                report.failures.append(f"grad of {name}: {'missing' if grad is None else 'unexpected'}")
            elif grad is not None:
                self._compare(report, report.grads, f"grad of {name}", grad, ref_grad)
        if report.unchecked:
            listed = "; ".join(f"{name} ({why})" for name, why in report.unchecked.items())
            warnings.warn(f"Verify did not compare the gradients of: {listed}", UncheckedGradientsWarning, stacklevel=3)

    def _origins(self, model: nn.Module) -> dict[str, tuple[int, list[str]]]:
        """Renamed parameters of ``model`` -> (dim, the original parameter names they concatenate)."""
        found: dict[str, tuple[int, list[str]]] = {}
        for prefix, module in model.named_modules():
            origins = getattr(module, "param_origins", None)
            for local, (dim, sources) in (origins() if callable(origins) else {}).items():
                paths = [self.original_paths.get(id(layer)) for layer, _ in sources]
                if None not in paths:
                    names = [f"{path}.{key}" if path else key for path, (_, key) in zip(paths, sources, strict=True)]
                    found[f"{prefix}.{local}" if prefix else local] = (dim, names)
        return found

    @staticmethod
    def _reference_grad(name: str, ref_params: dict, origins: dict, report: VerifyReport) -> torch.Tensor | None | bool:
        """The reference gradient for ``name`` (``None`` if it has none), or ``False`` if unknown."""
        if name in ref_params:
            return ref_params[name].grad
        if name not in origins:
            report.unchecked[name] = "no parameter of this name in the original model, and no recorded origin"
            return False
        dim, sources = origins[name]
        missing = [s for s in sources if s not in ref_params]
        if missing:
            report.unchecked[name] = f"its origins {missing} are not parameters of the original model"
            return False
        grads = [ref_params[s].grad for s in sources]
        if all(g is None for g in grads):
            return None
        if any(g is None for g in grads):
            report.failures.append(f"grad of {name}: only some of its origins {sources} have gradients")
            return False
        return torch.cat(grads, dim)


def _paired_outputs(out: Any, ref_out: Any, group: Group, report: VerifyReport) -> dict:
    """Output tensors by name, each scheduled one gathered to the reference's shape if partitioned."""
    mine, ref = _named_tensors(out), _named_tensors(ref_out)
    pairs = {}
    for name, r in ref.items():
        if name not in mine:
            report.failures.append(f"{name}: missing from the scheduled model's output")
            continue
        pairs[name] = (_gather_to(mine[name], r.shape, group), r)
    return pairs


def _gather_to(t: torch.Tensor, shape: torch.Size, group: Group) -> torch.Tensor:
    world = group_size(group)
    if t.shape == shape or t.dim() != len(shape):
        return t
    dims = [d for d in range(t.dim()) if t.shape[d] != shape[d]]
    if len(dims) == 1 and t.shape[dims[0]] * world == shape[dims[0]]:
        return all_gather(t, dims[0], group, backward="split")
    return t


def _named_tensors(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {"output": out}
    if isinstance(out, dict):  # includes HF ModelOutput
        return {f"output.{k}": v for k, v in out.items() if isinstance(v, torch.Tensor)}
    if isinstance(out, (tuple, list)):
        return {f"output[{i}]": v for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    raise TypeError(f"Verify cannot compare an output of type {type(out).__name__}; pass loss_fn")


def _probe_losses(pairs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Random linear functionals of the outputs: every output element gets a distinct gradient."""
    gen = torch.Generator().manual_seed(0)
    loss = ref_loss = 0.0
    for mine, ref in pairs.values():
        if not (ref.is_floating_point() and ref.requires_grad):
            continue
        w = torch.randn(ref.shape, generator=gen).to(ref.device, ref.dtype)
        loss = loss + (mine * w).sum()
        ref_loss = ref_loss + (ref * w).sum()
    if not isinstance(loss, torch.Tensor):
        raise VerificationError("no differentiable output to check gradients with; pass loss_fn or check_grads=False")
    return loss, ref_loss


def _broadcast(obj: Any, group: Group) -> Any:
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_clone(v) for v in obj)
    return obj
