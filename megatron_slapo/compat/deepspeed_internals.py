"""DeepSpeed's private names and the one patch we apply to it.

Written against deepspeed 0.19 (0.19.8).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn


def convert_to_zero_parameters(init: Any, params: list[nn.Parameter]) -> None:
    """Partition ``params`` over ``init``'s data-parallel group now, as ``deepspeed.zero.Init`` does
    to each module it sees built: ``Init._convert_to_zero_parameters``. The public form,
    ``zero.Init(module=...)``, recurses into every submodule, which would partition other build
    units' parameters too. deepspeed 0.19."""
    init._convert_to_zero_parameters(params)


def skip_shm_op_build() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory collective op (~30 s on a CPU) when its
    communication backend starts: ``deepspeed.comm.torch.build_shm_op`` replaced by a no-op. Only
    for CPU runs, which use gloo's collectives instead. deepspeed 0.19."""
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def zero_fragment(param: nn.Parameter) -> tuple[torch.Tensor, int, int, int] | None:
    """The piece of ``param``'s fp32 master weight this rank updates under ZeRO-1/2 (and DeepSpeed's
    ``BF16_Optimizer``), as ``(master, start, offset, group)``: ``master`` (a view into the live fp32
    partition) holds elements ``[start, start + master.numel())`` of ``param`` flattened; it starts
    at ``offset`` in the flat partition of the optimizer's param group ``group``, where AdamW's
    moments sit at the same offset. None when this rank updates none of ``param``. DeepSpeed links
    each parameter to its piece as ``param._hp_mapping`` (a ``deepspeed.utils.tensor_fragment``,
    which ``safe_get_full_fp32_param`` reads); the public ``safe_get_local_*`` functions cover
    ZeRO-3 only. deepspeed 0.19."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    return (mapping.hp_fragment, mapping.lp_fragment_address.start, mapping.hp_fragment_address.start,
            mapping.param_group_index)  # fmt: skip
