"""Attention on an explicit set of SDPA kernels, as a transformers attention implementation.

Megatron's ``--attention-backend`` names a kernel (``flash``, ``fused``); HF's ``"sdpa"`` lets torch
pick one, silently falling back to the math kernel when the chosen one cannot run. Here each
backend is an attention implementation registered with transformers' ``AttentionInterface``
(``"sdpa_fa"``, ``"sdpa_fused"``, ``"sdpa_math"``): HF's own SDPA path (masks, causality, grouped-query attention) run under
``torch.nn.attention.sdpa_kernel`` restricted to that backend's kernels, so a kernel that cannot
run fails instead of falling back. :func:`unavailable` says so before training starts.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

# Megatron's names -> torch's kernels ("fused": cuDNN's fused attention, else the memory-efficient one)
KERNELS = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "math": (SDPBackend.MATH,),
}


def _attention(kernels: tuple[SDPBackend, ...], module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    with sdpa_kernel(list(kernels)):
        return sdpa_attention_forward(module, *args, **kwargs)


def implementation(backend: str) -> str:
    """The ``attn_implementation`` name that runs SDPA on ``backend``'s kernels only (registered once)."""
    # transformers takes a name containing "flash" for a flash-attention package to import
    name = f"sdpa_{'fa' if backend == 'flash' else backend}"
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, functools.partial(_attention, KERNELS[backend]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # SDPA's mask format
    return name


def unavailable(backend: str, device: torch.device, dropout: float, dtype: torch.dtype = torch.float32) -> str | None:
    """Why ``backend``'s kernels cannot train here (a tiny causal attention in ``dtype`` with
    ``dropout``), or None. The dtype matters: flash attention takes only 16-bit inputs."""
    q = torch.zeros(1, 2, 8, 16, device=device, dtype=dtype, requires_grad=True)
    try:
        with sdpa_kernel(list(KERNELS[backend])), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns of each kernel it cannot use, then raises
            F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=dropout).sum().backward()
    except RuntimeError:
        with_dropout = f" with attention dropout {dropout:g}" if dropout else ""
        in_dtype = str(dtype).removeprefix("torch.")
        return f"torch has no {backend} attention kernel on {device.type} in {in_dtype}{with_dropout}"
    return None
