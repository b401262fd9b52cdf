"""Let megatron-core run on a CPU-only torch build (gloo backend).

megatron-core hard-codes CUDA in a few places that are otherwise device-agnostic: buffers are
allocated with ``device=torch.cuda.current_device()`` (tensor-parallel mappings, the global memory
buffer, pipeline receive buffers), the pipeline p2p code calls ``torch.cuda.synchronize()``, and its
RNG tracker reads and writes the CUDA generator; its optimizer and pipeline schedules create tensors
with a literal ``device="cuda"`` (:func:`device_mode`). On a machine without CUDA those calls
raise. This module maps them onto the CPU. It is the only place that does so, and :func:`apply` refuses to run
when CUDA is present, so GPU runs use megatron-core unchanged.

Measured in ../shared/notes/cpu-feasibility.md §1: with these shims megatron-core's TP layers, GPT
model, DDP and pipeline schedules give the same losses on CPU as their references.

Written against megatron-core 0.16 (0.16.1) and torch 2.13.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_applied = False


def is_applied() -> bool:
    return _applied


def apply() -> None:
    """Install the CPU shims (idempotent). Call before megatron-core allocates anything.

    Replaces ``torch.cuda``'s ``current_device``, ``synchronize``, ``get_rng_state``,
    ``set_rng_state`` and ``manual_seed`` process-wide, and megatron-core's private
    ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``, which its RNG tracker
    calls directly: megatron-core has no device setting to use instead. megatron-core 0.16, torch 2.13."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.apply() is for CPU-only machines; CUDA is available here")
    # NB: these replace torch.cuda functions for the whole process (there is no CUDA to lose).
    # Buffers allocated on "the current CUDA device" land on the CPU instead; megatron only passes
    # the result on as a device, so a device string stands in for the usual index.
    torch.cuda.current_device = lambda: "cpu"
    # p2p communication synchronises the device after batched sends/receives: nothing to wait for.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # megatron's CudaRNGStatesTracker forks "the CUDA generator": make that the CPU generator.
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    import megatron.core.tensor_parallel.random as mc_random

    # These two would otherwise queue the state change as a lazy CUDA call that never runs.
    mc_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mc_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _applied = True


class _CudaToCpu(TorchFunctionMode):
    """Inside megatron-core's optimizer and pipeline schedules: ``device="cuda"`` means the CPU.

    They create small tensors with a literal ``device="cuda"`` (the loss scale, the gradient-norm
    accumulator, token counts), call ``Tensor.cuda()``, and check ``Tensor.type()`` for
    ``torch.cuda.FloatTensor``. Under this mode such calls stay on (and report) the CPU tensors.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "cuda" in str(kwargs.get("device", "")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def device_mode() -> contextlib.AbstractContextManager:
    """The mode megatron-core's optimizer and schedules run under: CPU-for-CUDA here, nothing on a GPU."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    apply()
    return _CudaToCpu()
