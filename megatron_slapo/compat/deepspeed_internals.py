"""DeepSpeed's private names and the one patch we apply to it.

Written against deepspeed 0.19 (0.19.8).
"""

from __future__ import annotations

import importlib
from typing import Any

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
