"""megatron-core's private state (besides the CPU shims of :mod:`megatron_slapo.compat.megatron_cpu`).

Written against megatron-core 0.16 (0.16.1).
"""

from __future__ import annotations

import torch.distributed as dist


def parallel_state_groups() -> list[dist.ProcessGroup]:
    """Every process group megatron-core's ``parallel_state`` holds now, read from its private module
    globals (``_TENSOR_MODEL_PARALLEL_GROUP``, ``_DATA_PARALLEL_GROUP_GLOO``, and the lists and
    dicts of groups beside them): it has a getter per group, each of which raises when that group
    was not made, and no list of them. megatron-core 0.16."""
    from megatron.core import parallel_state as ps

    groups: dict[int, dist.ProcessGroup] = {}

    def collect(value: object) -> None:
        if isinstance(value, dist.ProcessGroup):
            groups[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)

    for name, value in vars(ps).items():
        if not name.startswith("__"):  # module globals only (not __builtins__)
            collect(value)
    return list(groups.values())
