"""``--log-comm``: the bytes each kind of collective moves, per step, per process group.

Counting happens where every engine's communication passes: the Python functions of
``torch.distributed``. While a :class:`CommLog` is installed they are replaced, in both
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (so that ``P2POp`` still recognises
``isend``/``irecv``; :func:`megatron_slapo.compat.distributed.wrap_collectives`), by wrappers that
add the payload to a counter keyed ``op[group]``, e.g. ``all_reduce[tp]``. Our tensor-parallel collectives, megatron-core's pipeline and gradient
buffers, DeepSpeed (through ``deepspeed.comm``) and FSDP2 all call these functions; torch DDP's C++
reducer does not, so :class:`~megatron_slapo.engines.ddp.DDPEngine` routes its buckets through a
comm hook that does.

The payload is the size of the whole tensor the collective works on: the tensor for all-reduce,
broadcast and point-to-point, the gathered output for all-gather, the input for reduce-scatter.
That is the quantity of Megatron's analytic counts (``2 x b x s x h`` per layer forward for TP).
Collectives over a single-rank group (megatron-core's DDP reduces even when there is one replica)
move nothing and are not counted.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_slapo.compat.distributed import unwrap_collectives, wrap_collectives


def _size(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


# op name -> (position and keyword of the tensor argument to count, position of ``group``)
_PAYLOAD = {
    "all_reduce": (0, "tensor", 2), "broadcast": (0, "tensor", 2), "reduce": (0, "tensor", 3),
    "all_gather": (0, "tensor_list", 2), "all_gather_into_tensor": (0, "output_tensor", 2),
    "all_gather_single": (0, "output_tensor", 2), "reduce_scatter": (1, "input_list", 3),
    "reduce_scatter_tensor": (1, "input", 3), "reduce_scatter_single": (1, "input", 3),
    "all_to_all_single": (1, "input", 4), "send": (0, "tensor", 2), "recv": (0, "tensor", 2),
    "isend": (0, "tensor", 2), "irecv": (0, "tensor", 2),
}  # fmt: skip


_SHOWN = {"all_to_all_single": "all_to_all"}  # the name a count is shown under, where it is not the function's


def group_names() -> dict[Any, str]:
    """Process groups by their megatron-core role: ``tp``, ``pp``, ``dp``, ``embd``, ``mp``, ``dp-cp``,
    ``ep``, ``etp``, ``edp``, ``cp``."""
    from megatron.core import parallel_state as ps

    names: dict[Any, str] = {}
    getters = {
        "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
        "dp": ps.get_data_parallel_group, "embd": ps.get_embedding_group,
        "mp": ps.get_model_parallel_group,  # tensor x pipeline: where gradient norms are summed
        "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),  # megatron-core DDP's
        # an MoE model's routed experts: where tokens move, and the copies their gradients are reduced over
        "ep": ps.get_expert_model_parallel_group, "etp": ps.get_expert_tensor_parallel_group,
        "edp": ps.get_expert_data_parallel_group,
        "cp": ps.get_context_parallel_group,  # the ranks splitting a sequence: the attention's keys and values
    }  # fmt: skip
    for name, get in getters.items():
        try:
            group = get()
        except (AssertionError, RuntimeError):  # not created (e.g. no embedding group without PP)
            continue
        if group is not None:
            names.setdefault(group, name)
    return names


class CommLog:
    """Installed, it counts every collective's bytes; :meth:`take` returns and resets the counts."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # how many times each was called (the time model's latencies)
        self._originals: dict[str, Callable] = {}
        self._names = group_names()
        self._depth = 0

    def _group_name(self, group: Any) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        return self._names.get(group, "other")

    def _wrap(self, op: str, fn: Callable) -> Callable:
        index, keyword, group_index = _PAYLOAD[op]

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[group_index] if len(args) > group_index else None)
            if self._depth == 0 and dist.get_world_size(group) > 1:  # counted once; a 1-rank group moves nothing
                payload = kwargs.get(keyword, args[index] if len(args) > index else None)
                key = f"{_SHOWN.get(op, op)}[{self._group_name(group)}]"
                self.bytes[key] += _size(payload)
                self.calls[key] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def install(self) -> CommLog:
        self._originals.update(wrap_collectives([op for op in _PAYLOAD if op not in self._originals], self._wrap))
        return self

    def uninstall(self) -> None:
        unwrap_collectives(self._originals)
        self._originals.clear()

    def take(self) -> dict[str, int]:
        """The counts since the last call, and start afresh (the calls too: :meth:`take_calls` first)."""
        out = dict(self.bytes)
        self.bytes.clear()
        self.calls.clear()
        return out

    def take_calls(self) -> dict[str, int]:
        """How many times each collective was called since the last :meth:`take`."""
        return dict(self.calls)
