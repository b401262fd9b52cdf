"""DeepSpeed's private names.

Written against deepspeed 0.19 (0.19.8).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def convert_to_zero_parameters(init: Any, params: list[nn.Parameter]) -> None:
    """Partition ``params`` over ``init``'s data-parallel group now, as ``deepspeed.zero.Init`` does
    to each module it sees built: ``Init._convert_to_zero_parameters``. The public form,
    ``zero.Init(module=...)``, recurses into every submodule, which would partition other build
    units' parameters too. deepspeed 0.19."""
    init._convert_to_zero_parameters(params)
