"""megatron-core's private state (besides the CPU shims of :mod:`megatron_slapo.compat.megatron_cpu`).

Written against megatron-core 0.16 (0.16.1).
"""

from __future__ import annotations

import torch
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


def distributed_optimizer_range(optimizer: object, param: torch.nn.Parameter) -> tuple[int, int]:
    """The elements ``[start, end)`` of ``param`` (flattened) that megatron-core's
    ``DistributedOptimizer`` ``optimizer`` keeps on this data-parallel rank (its fp32 main shard
    and Adam state), from its private ``_get_model_param_range_map(param)["param"]``: the public
    checkpoint paths gather or reshape these shards, and none says where a shard lies.
    megatron-core 0.16."""
    found = optimizer._get_model_param_range_map(param)["param"]
    return found.start, found.end
