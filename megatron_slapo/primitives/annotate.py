"""``annotate``: tag a parameter with a key/value that survives sharding and build.

The tag is set as an attribute of the tensor (how megatron-core and DeepSpeed read parameter
properties, e.g. ``sequence_parallel`` or ``allreduce``) and recorded on the schedule node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class AnnotateMixin:
    @primitive
    def annotate(self: ScheduleNode, param_name: str, key: str, value: Any) -> None:
        """Attach ``key = value`` to a parameter or buffer; it survives shard and build."""
        if not key.isidentifier():
            raise self._error(f"annotation key must be an identifier, got {key!r}")
        setattr(self._tensor(param_name), key, value)
        self.metadata.annotations.setdefault(param_name, {})[key] = value
