"""Explain's meta pass with its attention run as a GPU's fused attention kernel runs it.

HF's ``"sdpa"`` attention (what models get under ``--attention-backend auto``) calls
``F.scaled_dot_product_attention``, which on the meta device (as on the CPU) takes torch's math
path: it saves the ``batch x heads x s x s`` scores and probabilities for the backward, at 8k
tokens most of a layer's activations. On a GPU, SDPA runs a fused kernel instead (flash attention;
the memory-efficient and cuDNN ones keep the same): it saves q, k, v, the output and one fp32
log-sum-exp per row, and recomputes the probabilities in the backward.

:func:`attention_kernel` ``("flash")`` makes the SDPA attention implementations (HF's and the
``--attention-backend`` ones of ``kernels/attention.py``) call the flash kernel's own operator,
whose meta kernel, autograd formula and FLOP formulas are torch's: the pass then saves what flash
saves and counts what it computes, the forward's two products and, backward, the scores again
besides the four gradients' products (one ``q kᵀ`` per core more than the math path's backward).
``attention_kernel("softmax")`` runs them instead as Megatron-LM did before flash attention (a
scaled batched GEMM, its fused softmax, dropout and a second batched GEMM): how the published runs
of 2021 computed attention (tests/test_published_runs.py), which the time model prices by their
operators. They are swapped in transformers' registry of attention functions, which a module reads at each
call, so a core that ``attention_core`` wraps, or recomputes in the backward, runs the kernel too.

- Grouped-query attention reaches the kernel with keys and values unexpanded, as SDPA's
  ``enable_gqa`` gives them to it on a GPU.
- A mask (HF's causal one, ``--reset-attention-mask``'s documents), a sliding window or a position
  bias is not applied: only shapes matter on meta, and the FLOP formulas count the whole
  ``s x s``, as the math path's do.
- Values narrower than the keys (DeepSeek's latent attention) are padded to the keys' width, as
  HF pads them for flash attention.
- Cores that do not run SDPA are left alone: HF's eager attention (``--attention-backend
  unfused``/``local``, GPT-Neo's ``_attn``) keeps its probabilities on a GPU too, and the
  context-parallel ring (``kernels/ring_attention.py``) already saves only flash's tensors on meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megatron_slapo.compat.torch_internals import flash_attention
from megatron_slapo.kernels import attention

KERNELS = ("flash", "softmax")  # what estimate(attention=...) takes besides None (SDPA as it runs on meta: math)


def _flash(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
           is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An attention-interface function (``[batch, heads, tokens, dim]`` in, ``[batch, tokens,
    heads, dim]`` out, as HF's SDPA one) on the flash kernel; the mask unapplied (see above)."""
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    width = value.size(-1)
    if width < query.size(-1):
        value = F.pad(value, (0, query.size(-1) - width))
    out = flash_attention(query, key, value, dropout, causal, scale)[..., :width]
    return out.transpose(1, 2).contiguous(), None


def _softmax(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An attention-interface function as Megatron-LM computed attention before flash attention
    (its ``--attention-backend unfused``, the path of the SC'21 paper's runs): one batched GEMM for
    the scaled scores (``baddbmm``'s alpha), one fused scale-mask-softmax kernel, dropout, and one
    batched GEMM with the values; key/value groups expanded to every head first, as Megatron did."""
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    b, h, s, d = query.shape
    blank = query.new_empty(b * h, s, key.size(2))
    scores = torch.baddbmm(blank, query.reshape(b * h, s, d), key.reshape(b * h, -1, d).transpose(1, 2), beta=0.0,
                           alpha=scale)  # fmt: skip
    probs = F.dropout(torch.softmax(scores, dim=-1), dropout, training=module.training)
    out = torch.bmm(probs, value.reshape(b * h, -1, value.size(-1))).view(b, h, s, -1)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _sdpa_as(function: Any) -> Iterator[None]:
    """While open, the SDPA implementations in transformers' registry are ``function``."""
    names = ["sdpa", *(attention.implementation(backend) for backend in ("flash", "fused"))]
    originals = {name: ALL_ATTENTION_FUNCTIONS[name] for name in names}
    for name in names:
        AttentionInterface.register(name, function)
    try:
        yield
    finally:
        for name, function in originals.items():
            AttentionInterface.register(name, function)


def attention_kernel(kernel: str | None) -> contextlib.AbstractContextManager[None]:
    """A context in which HF's SDPA attention runs as ``kernel`` does (``"flash"``), or as SDPA runs
    on meta (``None``: the math path, which keeps the score matrices)."""
    if kernel is None:
        return contextlib.nullcontext()
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: one of {', '.join(KERNELS)}, or None")
    return _sdpa_as(_flash if kernel == "flash" else _softmax)
