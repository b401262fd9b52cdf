"""Drop-in kernels for HF modules that spell their maths out as a chain of elementwise ops.

Each op of such a chain reads and writes the whole activation and keeps its input for the
backward; torch has the same function as one vectorised kernel forward and one backward:

- GPT-2 and GPT-Neo use ``gelu_new`` (HF's ``NewGELUActivation``): GeLU's tanh approximation in
  seven ops, where ``F.gelu(x, approximate="tanh")`` is one (2 CPU cores, fp32, 2048 x 3072 with
  its bias add: 16 ms forward and backward instead of 52). Megatron fuses the bias add into it as
  well; here the column-parallel layer's ``addmm`` already adds the bias inside the GEMM, and
  ``--compile`` fuses whatever remains of the layer.
- Llama's RMS norm (and every family that copies its code) upcasts, squares, averages, adds,
  takes the reciprocal square root and multiplies: ``F.rms_norm`` on the upcast input, one fused
  kernel where torch has one (CUDA). On a CPU torch composes it from the same ops, at the same
  speed (2 cores, 4096 x 2048 forward and backward: 99 ms either way in fp32, 138 vs 143 in bf16).

:func:`~megatron_slapo.plans.kernel_swap.swap_in_kernels` replaces those modules by type (the RMS norm by its very code, so a
variant that computes something else, Gemma's ``1 + weight`` say, is left alone); schedules call it
after their plan. Each replacement computes the same function, up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import FastGELUActivation, NewGELUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

# HF activations that compute GeLU's tanh approximation as a formula (QuickGELU is another function)
TANH_FORMULAS = (NewGELUActivation, FastGELUActivation)


class GeLU(nn.Module):
    """``F.gelu``: GeLU (``approximate="none"``) or its tanh approximation in one kernel."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class RMSNorm(nn.Module):
    """Llama's RMS norm (computed in fp32, scaled in the input's dtype) through ``F.rms_norm``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"))  # the replaced norm's, by name
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.size(-1),), eps=self.variance_epsilon).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _code(fn: object) -> tuple:
    code = fn.__code__
    return code.co_code, code.co_names, code.co_consts


def _same_forward(module: nn.Module, known: type[nn.Module]) -> bool:
    forward = getattr(type(module), "forward", None)
    return hasattr(forward, "__code__") and _code(forward) == _code(known.forward)


def _is_llama_rms_norm(module: nn.Module) -> bool:
    return _same_forward(module, LlamaRMSNorm)


def rms_norm_form(module: nn.Module) -> str | None:
    """``"llama"`` (the weight times the input cast back: ``weight * x.to(dtype)``), ``"olmo2"``
    (cast after the weight: ``(weight * x).to(dtype)``) for an HF RMSNorm whose forward is the one
    of those classes (copied across families as they are), else None: a norm of another formula."""
    if _is_llama_rms_norm(module):
        return "llama"
    return "olmo2" if _same_forward(module, Olmo2RMSNorm) else None


def kernel_for(module: nn.Module) -> nn.Module | None:
    """The drop-in kernel that computes what ``module`` computes, or ``None``."""
    if type(module) in TANH_FORMULAS:
        return GeLU("tanh")
    if _is_llama_rms_norm(module):
        return RMSNorm(module.weight.size(0), module.variance_epsilon)
    return None
