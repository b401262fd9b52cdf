"""The schedule tree: one node per submodule, addressed by dotted path.

``create_schedule(model)`` mirrors ``model``'s module tree; ``sch["transformer.h.0.mlp"]`` is the
node of that submodule (ModuleList children by index). Primitives are methods of a node and
rewrite how its module runs; the node records what was done (shards, syncs, annotations) so that
``build`` and ``Verify`` can act on it. The primitives themselves live in
:mod:`megatron_slapo.primitives`, one family per file, and reach ``Schedule`` as mixins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from megatron_slapo.explain import explain
from megatron_slapo.node import ScheduleNode
from megatron_slapo.parallel.state import default_group
from megatron_slapo.primitives import registry
from megatron_slapo.primitives.annotate import AnnotateMixin
from megatron_slapo.primitives.attention_core import AttentionCoreMixin
from megatron_slapo.primitives.checkpoint import CheckpointMixin
from megatron_slapo.primitives.compile import CompileMixin
from megatron_slapo.primitives.find import FindMixin
from megatron_slapo.primitives.fp8 import Fp8Mixin
from megatron_slapo.primitives.fuse import FuseMixin
from megatron_slapo.primitives.hook import HookMixin
from megatron_slapo.primitives.pipeline import PipelineMixin
from megatron_slapo.primitives.replace import ReplaceMixin
from megatron_slapo.primitives.rng import ForkRngMixin
from megatron_slapo.primitives.shard import ShardMixin
from megatron_slapo.primitives.sync import SyncMixin
from megatron_slapo.primitives.trace import TraceMixin


class Schedule(
    ScheduleNode,
    ReplaceMixin,
    ShardMixin,
    SyncMixin,
    CheckpointMixin,
    CompileMixin,
    Fp8Mixin,
    HookMixin,
    ForkRngMixin,
    AttentionCoreMixin,
    AnnotateMixin,
    TraceMixin,
    FindMixin,
    FuseMixin,
    PipelineMixin,
):
    """A node of the schedule tree with every primitive as a method; see :func:`create_schedule`."""

    def explain(self) -> str:
        """What the primitives did to this module and those below it, a line a module (see
        :mod:`megatron_slapo.explain`): ``print(sch.explain())``."""
        return explain(self)


def create_schedule(model: nn.Module, group: dist.ProcessGroup | None = None) -> Schedule:
    """Create the schedule tree of ``model``.

    ``group`` is the process group that ``shard``/``sync`` act over. By default it is the
    tensor-parallel group when :func:`megatron_slapo.parallel.initialize` has run, else the world
    group when torch.distributed is initialised, else none (single process).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_schedule expects an nn.Module, got {type(model).__name__}")
    return Schedule(model, group=group if group is not None else default_group())


def register_primitive(fn: Callable, name: str | None = None) -> Callable:
    """Add a user primitive: ``fn(sch, *args, **kwargs)`` becomes ``sch.<name>(*args, **kwargs)``.

    Raises ``ValueError`` if the name is taken (by a built-in or an earlier registration).
    Usable as a decorator.
    """
    name = name or fn.__name__
    if hasattr(Schedule, name) and not registry.is_primitive(name):
        raise ValueError(f"{name!r} is already an attribute of Schedule and cannot be a primitive")
    registry.add(name, fn)
    setattr(Schedule, name, fn)
    return fn
