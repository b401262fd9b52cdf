"""The work of a meta pass, operator by operator, as the time model needs it.

:class:`OpLedger` is a dispatch mode that sees every ATen operator a forward and backward run,
and files each as one of three kinds of work:

- ``gemm``: matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, FP8's scaled ``mm``,
  convolutions), by compute dtype, smallest dimension (a GEMM's efficiency falls with it: tile
  quantisation) and whether every dimension is a multiple of :data:`ALIGNMENT` (tensor cores
  need it: GPT-2's vocabulary of 50,257 makes its LM head's GEMMs crawl);
- ``attention``: fused attention kernels (SDPA's flash, memory-efficient and cuDNN kernels, forward
  and backward), by dtype;
- ``other``: everything else that computes (elementwise, reductions, copies, embeddings' gathers),
  by the bytes it reads and writes: such work runs at memory speed.

Views and allocations compute nothing and are left out. The elementwise work inside modules that
``torch.compile`` runs (:meth:`OpLedger.fusing`) is counted apart too: it fuses into few kernels. FLOPs are torch's own formulas
(``torch.utils.flop_counter``), the ones explain's totals and the MFU of the log line count.
Each is filed under the phase it runs in: ``forward``, ``backward``, or ``recompute`` (an
activation checkpoint's forward, re-run inside the backward: autograd's engine runs the backward with
gradients disabled, and the checkpoint enables them to re-run the forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.torch_internals import (
    ATTENTION_OPS,
    FREE_OPS,
    GEMM_OPS,
    TorchDispatchMode,
    flop_formulas,
    in_autograd_engine,
    op_schema,
)

PHASES = ("forward", "backward", "recompute")
ALIGNMENT = 8  # elements: 16 bytes of a 16-bit dtype, what cuBLAS's tensor-core kernels load at once


def dtype_name(dtype: torch.dtype) -> str:
    """The peak a product of ``dtype`` runs at: ``fp8``, ``bf16`` (16-bit floats) or ``fp32``."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        return "fp8"
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


@dataclass
class Work:
    """One phase's work: GEMMs by ``(dtype, smallest dimension, aligned)`` -> [calls, FLOPs], attention by
    dtype -> [calls, FLOPs], and the other operators' calls and bytes."""

    gemm: dict[tuple[str, int, bool], list[float]] = field(default_factory=dict)
    attention: dict[str, list[float]] = field(default_factory=dict)
    other_calls: int = 0
    other_bytes: int = 0
    other_elements: int = 0  # of their results: a CPU's arithmetic per element (exp, tanh) costs beyond the bytes
    fused_bytes: int = 0  # of other_bytes, those inside modules torch.compile fuses (--compile's layers)

    def add(self, other: Work, times: int = 1) -> None:
        """Add ``times`` runs of ``other`` to this."""
        for table, theirs in ((self.gemm, other.gemm), (self.attention, other.attention)):
            for key, (calls, flops) in theirs.items():
                mine = table.setdefault(key, [0, 0.0])
                mine[0] += times * calls
                mine[1] += times * flops
        self.other_calls += times * other.other_calls
        self.other_bytes += times * other.other_bytes
        self.other_elements += times * other.other_elements
        self.fused_bytes += times * other.fused_bytes

    @property
    def flops(self) -> float:
        return sum(f for _, f in self.gemm.values()) + sum(f for _, f in self.attention.values())

    def to_json(self) -> dict[str, Any]:
        return {"gemm": [[*key, calls, flops] for key, (calls, flops) in sorted(self.gemm.items())],
                "attention": {k: v for k, v in sorted(self.attention.items())},
                "other_calls": self.other_calls, "other_bytes": self.other_bytes,
                "other_elements": self.other_elements, "fused_bytes": self.fused_bytes}  # fmt: skip


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among an operator's arguments or results (nested in lists, tuples and dicts)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, dict):
        values = list(values.values())
    return [t for v in values for t in _tensors(v)] if isinstance(values, (list, tuple)) else []


def _bytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(values))


def _is_view(func: Any) -> bool:
    """An operator whose output aliases an input: a view, no work."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op_schema(func).returns)


def _dims(name: str, args: tuple) -> tuple[int, ...]:
    """A GEMM's m, k and n (a convolution's: output channels and the weight's other elements)."""
    if name in ("convolution", "convolution_backward"):
        return int(args[1].shape[0]), int(args[1][0].numel())
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    return int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])


class OpLedger(TorchDispatchMode):
    """Files every operator's work under the current stage and phase (see the module docstring).
    ``backward`` is set by the caller around autograd's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.stage = 0
        self.backward = False
        self.work: dict[tuple[int, str], Work] = {}
        self._fused = 0  # depth inside compiled modules' forwards (a recomputed one's too)
        self._formulas = flop_formulas()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in FREE_OPS or _is_view(func):  # no work
            return out
        recomputing = torch.is_grad_enabled() and in_autograd_engine()
        phase = ("recompute" if recomputing else "backward") if self.backward else "forward"
        work = self.work.setdefault((self.stage, phase), Work())
        formula = self._formulas.get(func.overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula else 0
        tensors = [t for t in _tensors(args) if t.is_floating_point()]
        dtype = dtype_name(tensors[0].dtype) if tensors else "fp32"
        if name in GEMM_OPS and flops:
            dims = _dims(name, args)
            entry = work.gemm.setdefault((dtype, min(dims), all(d % ALIGNMENT == 0 for d in dims)), [0, 0.0])
        elif flops and any(name.startswith(prefix) for prefix in ATTENTION_OPS):
            entry = work.attention.setdefault(dtype, [0, 0.0])
        else:
            work.other_calls += 1
            work.other_bytes += _bytes((args, kwargs)) + _bytes(out)
            work.other_elements += sum(t.numel() for t in _tensors(out))
            work.fused_bytes += (_bytes((args, kwargs)) + _bytes(out)) if self._fused else 0
            return out
        entry[0] += 1
        entry[1] += flops
        return out

    @contextlib.contextmanager
    def fusing(self, modules: list[nn.Module]) -> Iterator[None]:
        """While open, the elementwise work of ``modules``' forwards (those ``torch.compile`` runs)
        is also counted as fused."""

        def enter(*_: Any) -> None:
            self._fused += 1

        def leave(*_: Any) -> None:
            self._fused -= 1

        handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def phases(self, stages: list[int], times: int) -> dict[str, Work]:
        """The work of ``stages`` together, each phase ``times`` over (the micro-batches of a step)."""
        total = {phase: Work() for phase in PHASES}
        for (stage, phase), work in self.work.items():
            if stage in stages:
                total[phase].add(work, times)
        return total
