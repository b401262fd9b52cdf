"""What a training step holds, measured on the run itself, in the terms of ``tools/explain.py``.

The trainer measures the first step it takes (``Reporter.measure_memory``) and logs, per rank:

- activations: the bytes autograd saves for backward, counted as explain's meta pass counts them
  (saved-tensor hooks; each storage once while it lives; weights excluded), per micro-batch;
- peak: on a GPU, the CUDA allocator's most bytes allocated during the step; on a CPU, which keeps
  no such count, the most saved bytes alive at once plus the engine's weight, gradient and
  optimizer bytes (its memory report), the sum explain's peak is an estimate of.

The hooks only look (every saved tensor is handed back as it came), so the step computes exactly
what it would unmeasured, and they are removed when the step ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_slapo.compat.torch_internals import view_base


@dataclass(frozen=True)
class StepMemory:
    """One rank's measured step, in bytes."""

    activations: float  # saved for backward, per micro-batch
    peak: int
    peak_source: str  # what ``peak`` counts


def _storage_address(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a DTensor, or an FSDP2 shard whose storage is freed
        return None


class StepMeter:
    """``with StepMeter(...) as meter:`` around one step; then ``meter.result``.

    Activations: the storages autograd saves, each once while it lives (one freed and then reused
    by the allocator is a new one, as it is for autograd); ``peak_saved`` is the most bytes of them
    alive at once (1F1B holds several micro-batches'). A weight is not counted: a parameter, a view
    of one, or a tensor on a parameter's storage (ZeRO-3 and FSDP2 gather into parameters too)."""

    def __init__(self, model: nn.Module, memory_report: Callable[[], dict[str, int]], micro_batches: int) -> None:
        """``memory_report``: the engine's, read after the step (its optimizer state exists by then)."""
        self._weights = {_storage_address(p) for p in model.parameters()} - {None}
        self._memory_report, self._micro_batches = memory_report, micro_batches
        self._alive: dict[int, int] = {}  # address -> bytes, of each counted storage still allocated
        self._finalizers: list[weakref.finalize] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.total = self.live = self.peak_saved = 0
        self.result: StepMemory | None = None

    def _is_weight(self, t: torch.Tensor, address: int) -> bool:
        base = view_base(t)
        return isinstance(t if base is None else base, nn.Parameter) or address in self._weights

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            size, address = storage.nbytes(), storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a DTensor, a sparse tensor, a
            return t  # weight FSDP2 gathered in float8: a parameter, which is not counted anyway)
        if size and address not in self._alive and not self._is_weight(t, address):
            self._alive[address] = size
            self.total += size
            self.live += size
            self.peak_saved = max(self.peak_saved, self.live)
            # a storage's Python object lives exactly as long as the storage: the finalizer runs when it is freed
            self._finalizers.append(weakref.finalize(storage, self._freed, address))
        return t

    def _freed(self, address: int) -> None:
        self.live -= self._alive.pop(address)

    def __enter__(self) -> StepMeter:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # the step's peak, not the build's
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for finalizer in self._finalizers:  # storages that outlive the step: no call-back later
            finalizer.detach()
        self._finalizers.clear()
        if exc[0] is not None:
            return
        if torch.cuda.is_available():
            peak, source = torch.cuda.max_memory_allocated(), "the CUDA allocator's most allocated"
        else:
            peak = self.peak_saved + sum(self._memory_report().values())
            source = "saved activations + parameters + gradients + optimizer"
        self.result = StepMemory(self.total / self._micro_batches, peak, source)
