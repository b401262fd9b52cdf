"""torchao's float8 training pieces that :mod:`megatron_slapo.kernels.fp8` builds on.

torchao exports ``Float8LinearConfig``, ``Float8TrainingTensor``, ``GemmInputRole``,
``LinearMMConfig`` and ``ScaledMMConfig`` from ``torchao.float8``. The two functions that cast a
tensor with a given scale (``float8_training_tensor.hp_tensor_and_scale_to_float8``) and turn an
amax into a scale (``float8_utils.amax_to_scale``) live in its modules and are not promised to stay;
so they are reached here, written against torchao 0.18.

Its import logs a warning for every CUDA extension the wheel carries that this machine cannot load
(all of them on a CPU), and torch's pytree a deprecation note for each enum torchao registers;
neither concerns training, and transformers imports torchao whenever it is installed, so
``import megatron_slapo`` filters those notes out (:func:`quiet_torchao_import`).
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn


def _torchao_import_note(record: logging.LogRecord) -> bool:
    """Whether ``record`` is one of the notes importing torchao logs on a machine without its CUDA
    kernels: a CUDA extension it could not load, or torch's deprecation of its enum registrations."""
    if record.name == "torchao":
        return record.getMessage().startswith("Failed to load")
    return record.name == "torch.utils._pytree" and any(
        getattr(arg, "__module__", "").startswith("torchao") for arg in (record.args or ()) if isinstance(arg, type)
    )


def quiet_torchao_import() -> None:
    """Drop the notes of :func:`_torchao_import_note`, wherever torchao is imported from (transformers
    imports it for its quantizers whenever it is installed). A filter, not a level: importing
    ``torch._dynamo`` sets torch's loggers' levels anew."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(lambda record: not _torchao_import_note(record))


@functools.cache
def torchao_float8() -> SimpleNamespace:
    """The names :mod:`megatron_slapo.kernels.fp8` uses, imported once."""
    from torchao.float8 import Float8LinearConfig, Float8TrainingTensor, GemmInputRole, LinearMMConfig, ScaledMMConfig
    from torchao.float8.config import Float8LinearRecipeName, ScalingGranularity
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    return SimpleNamespace(
        Float8LinearConfig=Float8LinearConfig, Float8TrainingTensor=Float8TrainingTensor,
        GemmInputRole=GemmInputRole, LinearMMConfig=LinearMMConfig, ScaledMMConfig=ScaledMMConfig,
        Float8LinearRecipeName=Float8LinearRecipeName, ScalingGranularity=ScalingGranularity,
        hp_tensor_and_scale_to_float8=hp_tensor_and_scale_to_float8, amax_to_scale=amax_to_scale,
    )  # fmt: skip


def is_float8(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is already cast (torchao's ``Float8TrainingTensor``, as FSDP2's float8
    all-gather delivers a weight)."""
    return isinstance(tensor, torchao_float8().Float8TrainingTensor)


def float8_gathered(weight: nn.Parameter, mm_config: Any, dtype: torch.dtype) -> nn.Parameter:
    """``weight`` as a parameter FSDP2 all-gathers in float8: torchao's
    ``fsdp_utils.WeightWithDynamicFloat8CastTensor``, which casts each shard with the whole weight's
    scale (its amax all-reduced over the FSDP mesh) before the all-gather, and delivers a
    ``Float8TrainingTensor``. ``torchao.float8.convert_to_float8_training`` applies it only to its
    own ``Float8Linear`` modules; our FP8 layers keep their class."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return nn.Parameter(WeightWithDynamicFloat8CastTensor(weight.data, mm_config, dtype),
                        requires_grad=weight.requires_grad)  # fmt: skip
