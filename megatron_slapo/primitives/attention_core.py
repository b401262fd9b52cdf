"""``attention_core``: fork the RNG of, or recompute, only the core of an HF attention module.

Megatron's core attention is ``softmax(q kᵀ) v`` with its dropout, between the projections. Two
things happen there and nowhere else in a layer: under tensor parallelism each rank holds other
heads, so the attention-probability dropout must draw other masks on each rank (the model-parallel
RNG stream), while the dropout after the row-parallel projection, on replicated activations, must
draw the same ones; and its ``b x heads x s x s`` probabilities are the cheapest activations to
recompute for the memory they take (Megatron's ``--recompute-granularity selective``). Forking or
checkpointing the whole HF attention module would get both wrong (GPT-2's also holds the residual
dropout) or save little, so this primitive reaches inside:

- modules that call transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``: GPT-2, OPT,
  Llama, BERT and most of transformers 5) get a private copy of their config whose
  ``_attn_implementation`` names a registered wrapper of the implementation they used (the model's
  own config, which decides the mask format, is untouched);
- modules with their own ``_attn`` method (GPT-Neo) get that method wrapped.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megatron_slapo.compat.transformers_internals import (
    attn_implementation,
    calls_attn_method,
    class_attn_method,
    set_attn_implementation,
    set_attn_method,
)
from megatron_slapo.kernels.context_attention import interface_attention, method_attention
from megatron_slapo.primitives.checkpoint import checkpointed
from megatron_slapo.primitives.registry import primitive
from megatron_slapo.primitives.rng import on_model_parallel_rng

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode
    from megatron_slapo.parallel.context import ContextParallel

PREFIX = "slapo_core:"  # registered attention implementations: PREFIX + the one wrapped


def core_kind(module: nn.Module) -> str | None:
    """``"interface"``, ``"method"`` (see the module docstring), or ``None``: no attention core.

    Read from the names the class's ``forward`` refers to, so a decoder layer, which calls its
    attention module rather than the attention functions, has none."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)  # under HF's decorators
    names = code.co_names if code is not None else ()
    if "ALL_ATTENTION_FUNCTIONS" in names and hasattr(module, "config"):
        return "interface"
    if calls_attn_method(module, names):
        return "method"
    return None


@dataclass
class AttentionCore:
    """What runs around one module's attention core."""

    fork_rng: bool = False
    checkpoint: bool = False
    context: Callable[..., Any] | None = None  # context parallelism: the ring in the core's place

    def __call__(self, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        inner = self.context or inner
        # HF's attention functions take their dropout probability: at 0 (evaluation, or a model
        # without attention dropout, as Llama) nothing random runs, so the fork would change
        # nothing, and under torch.compile it would split the layer's graph in four
        forked = self.fork_rng and kwargs.get("dropout") != 0
        fn = functools.partial(on_model_parallel_rng, inner) if forked else inner
        return checkpointed(fn, *args, **kwargs) if self.checkpoint else fn(*args, **kwargs)


def _wrapped_interface(name: str) -> str:
    """Register (once) the attention implementation ``PREFIX + name`` that runs ``name`` inside the
    calling module's :class:`AttentionCore`."""
    key = PREFIX + name

    def attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if name == "eager":  # each model file has its own eager function, the interface's default
            inner = sys.modules[type(module).__module__].eager_attention_forward
        else:
            inner = ALL_ATTENTION_FUNCTIONS[name]
        return module.slapo_attention_core(inner, module, *args, **kwargs)

    if key not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(key, attention)
    return key


def _core_attn(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self.slapo_attention_core(functools.partial(class_attn_method(type(self)), self), *args, **kwargs)


class AttentionCoreMixin:
    @primitive
    def attention_core(self: ScheduleNode, *, fork_rng: bool = False, checkpoint: bool = False,
                       context_parallel: ContextParallel | None = None) -> None:  # fmt: skip
        """Run this HF attention module's core (``softmax(q kᵀ) v`` and its dropout) on the
        model-parallel RNG stream (``fork_rng``) and/or recomputed in the backward (``checkpoint``),
        and/or as the ring over ``context_parallel``'s ranks, each holding its part of the sequence
        (``kernels/ring_attention.py``; causal self-attention only). May be applied again to add
        another."""
        mod = self.mod
        kind = core_kind(mod)
        if kind is None:
            raise self._error(f"{type(mod).__name__} has no attention core to reach: apply attention_core() "
                              "to the module that calls the attention function (e.g. self_attn, attn)")  # fmt: skip
        if getattr(mod, "reorder_and_upcast_attn", False):  # GPT-2 takes that path only under "eager" by name
            raise self._error("attention_core() does not reach GPT-2's reorder_and_upcast_attn path")
        core = mod.__dict__.get("slapo_attention_core")
        if core is None:
            core = AttentionCore()
            if kind == "interface":
                implementation = attn_implementation(mod.config)
                mod.config = copy.copy(mod.config)  # this module's alone: the model's decides the mask format
                set_attn_implementation(mod.config, _wrapped_interface(implementation))
            else:
                set_attn_method(mod, _core_attn)
            mod.slapo_attention_core = core
        if context_parallel is not None:
            if core.context is not None:
                raise self._error("attention_core(context_parallel=...) is already applied to this module")
            if not getattr(mod, "is_causal", True):
                raise self._error(f"{type(mod).__name__} is not causal: context parallelism splits decoders' "
                                  "self-attention only")  # fmt: skip
            core.context = (functools.partial(interface_attention, context_parallel) if kind == "interface"
                            else functools.partial(method_attention, context_parallel, mod))  # fmt: skip
        for flag, wanted in (("fork_rng", fork_rng), ("checkpoint", checkpoint)):
            if wanted and getattr(core, flag):
                raise self._error(f"attention_core({flag}=True) is already applied to this module")
            setattr(core, flag, getattr(core, flag) or wanted)
        self.metadata.forked_rng |= fork_rng
        if context_parallel is not None:
            self.metadata.context_parallel = context_parallel.size
        self.metadata.core_checkpointed |= checkpoint
