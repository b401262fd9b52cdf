"""Context parallelism (``--context-parallel-size``) on any causal decoder, through the schedule.

Each rank runs every layer on its part of the sequence (``parallel/context.py`` says which part).
Everything but attention is per token and needs nothing else: the embedding (at the rank's
positions, which the task passes), norms, MLPs, the LM head and the loss. Attention is the one
place tokens meet, so each attention module's core (``softmax(q kᵀ) v``, between the projections
and after rotary positions) becomes the ring over the context-parallel ranks, applied with the
``attention_core`` primitive; the model's code is untouched. Under tensor parallelism each rank's
ring carries its own heads; under sequence parallelism the core sees the rank's part of the
sequence gathered over the tensor-parallel ranks, as without context parallelism.

The model builds no attention mask (:func:`without_masks`): the ring knows every token's place.
The trainer applies this plan first, before a pipeline's trace, which runs the layers (on the
meta device, where the ring only gives its output's shape) and records how the masks are built.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from megatron_slapo.compat.transformers_internals import set_attn_implementation
from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels.context_attention import register
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.parallel.context import ContextParallel
from megatron_slapo.primitives.attention_core import core_kind
from megatron_slapo.schedule import Schedule


def without_masks(model: nn.Module) -> None:
    """Make ``model`` build no attention masks: ``model`` and its modules that shared its config get a
    copy naming the context-parallel attention (the run's config object, which FLOP counts and
    exported checkpoints read, keeps its attention; sub-configs of a composite config are shared)."""
    config: Any = getattr(model, "config", None)
    if config is None:
        raise SchedulingError(f"{type(model).__name__} has no HF config: context parallelism splits HF decoders")
    own = copy.copy(config)
    set_attn_implementation(own, register())
    for module in model.modules():
        if getattr(module, "config", None) is config:
            module.config = own


def split_attention(sch: Schedule, cp: ContextParallel) -> list[str]:
    """Run every attention module's core as the ring over ``cp``'s ranks; return their paths."""
    paths = [path for path, node in sch.named_schedules() if core_kind(node.mod) is not None]
    config = getattr(sch.mod, "config", None)
    layers = transformer_layers(sch.mod, config.num_hidden_layers) if config is not None else []
    unsplit = [layer for layer in layers if not any(path.startswith(f"{layer}.") for path in paths)]
    if unsplit or not paths:  # a layer that mixes tokens otherwise (MiniMax's linear attention) would see its part only
        where = f"its layer {unsplit[0]}" if unsplit else type(sch.mod).__name__
        raise SchedulingError(f"--context-parallel-size {cp.size}: {where} has no attention module that calls "
                              "transformers' attention functions (or GPT-Neo's _attn) for the ring to replace")  # fmt: skip
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap:  # Gemma 2's: tanh-capped scores, which the ring's online softmax and its backward do not apply
        raise SchedulingError(f"--context-parallel-size {cp.size}: {config.model_type} caps its attention scores "
                              f"(attn_logit_softcapping={cap}), which the context-parallel ring does not apply")  # fmt: skip
    for path in paths:
        sch[path].attention_core(context_parallel=cp)
    without_masks(sch.mod)
    return paths
