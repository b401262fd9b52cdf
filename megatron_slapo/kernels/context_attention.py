"""Context-parallel attention in the forms an HF attention module calls (``kernels/ring_attention.py``).

transformers' modules call their attention core in one of two forms: the attention interface
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=,
scaling=, sliding_window=, ...)``, returning ``[batch, tokens, heads, dim]``), or, in GPT-Neo, a
``_attn(q, k, v, mask)`` method of their own (unscaled scores in fp32, local layers looking
``window_size`` tokens back). Each is answered here by the ring over the context-parallel ranks;
the ``attention_core`` primitive puts it in the module's place.

The masks the model builds are not needed: the ring knows where every token lies. The model's
config names :data:`NAME`, registered here as an attention implementation whose mask is none, so
the model builds none (a ``seq x seq`` mask per batch at 16k tokens is 256 MB); a module left
calling the interface by that name fails with a message rather than attending locally.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from megatron_slapo.kernels.ring_attention import context_attention
from megatron_slapo.parallel.context import ContextParallel

NAME = "slapo_context_parallel"


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _not_placed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(f"{type(module).__name__} calls attention on its part of the sequence without the "
                       "context-parallel core: the schedule's context-parallel plan missed it")  # fmt: skip


def register() -> str:
    """Register (once) :data:`NAME` with transformers' attention and mask interfaces; return it."""
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, _not_placed)
        AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


def _refuse_extras(module: nn.Module, attention_mask: Any, kwargs: dict[str, Any]) -> None:
    if attention_mask is not None:
        raise RuntimeError(f"{type(module).__name__} got an attention mask: context parallelism attends causally "
                           "over the whole sequence and takes no padding or document mask")  # fmt: skip
    extras = sorted(k for k in ("softcap", "s_aux") if kwargs.get(k) is not None)
    if extras:
        raise RuntimeError(f"{type(module).__name__} passes {', '.join(extras)} to its attention, which the "
                           "context-parallel ring does not apply")  # fmt: skip


def interface_attention(cp: ContextParallel, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                        scaling: float | None = None, sliding_window: int | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    """An attention-interface function: ``[batch, heads, tokens, dim]`` in, ``[batch, tokens, heads, dim]`` out."""
    _refuse_extras(module, attention_mask, kwargs)
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    out = context_attention(query, key, value, cp, scale=scale, dropout=dropout, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def method_attention(cp: ContextParallel, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:  # fmt: skip
    """GPT-Neo's ``_attn``: unscaled scores in fp32, a window on its local layers, its own dropout's rate."""
    _refuse_extras(module, attention_mask, {})
    window = module.config.window_size if getattr(module, "attention_type", None) == "local" else None
    dropout = module.attn_dropout.p if module.training else 0.0
    out = context_attention(query.float(), key.float(), value.float(), cp, scale=1.0, dropout=dropout, window=window)
    return out.to(value.dtype), None
