"""The schedule tree: one node per submodule, addressed by dotted path.

``create_schedule(model)`` mirrors ``model``'s module tree; ``sch["transformer.h.0.mlp"]`` is the
node of that submodule (ModuleList children by index). Primitives are methods of a node and
rewrite how its module runs; the node records what was done (shards, syncs, annotations) so that
``build`` and ``Verify`` can act on it. The primitives themselves live in
:mod:`megatron_slapo.primitives`, one family per file, and reach ``Schedule`` as mixins.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.errors import SchedulingError
from megatron_slapo.explain import explain
from megatron_slapo.metadata import Metadata
from megatron_slapo.parallel.collectives import group_rank, group_size
from megatron_slapo.parallel.state import default_group
from megatron_slapo.primitives.annotate import AnnotateMixin
from megatron_slapo.primitives.attention_core import AttentionCoreMixin
from megatron_slapo.primitives.checkpoint import CheckpointMixin
from megatron_slapo.primitives.compile import CompileMixin
from megatron_slapo.primitives.find import FindMixin
from megatron_slapo.primitives.fuse import FuseMixin
from megatron_slapo.primitives.hook import HookMixin
from megatron_slapo.primitives.pipeline import PipelineMixin
from megatron_slapo.primitives.replace import ReplaceMixin
from megatron_slapo.primitives.rng import ForkRngMixin
from megatron_slapo.primitives.shard import ShardMixin
from megatron_slapo.primitives.sync import SyncMixin
from megatron_slapo.primitives.trace import TraceMixin


class Schedule(
    ReplaceMixin,
    ShardMixin,
    SyncMixin,
    CheckpointMixin,
    CompileMixin,
    HookMixin,
    ForkRngMixin,
    AttentionCoreMixin,
    AnnotateMixin,
    TraceMixin,
    FindMixin,
    FuseMixin,
    PipelineMixin,
):
    """A node of the schedule tree; see :func:`create_schedule`."""

    def __init__(
        self,
        mod: nn.Module,
        name: str = "",
        parent: Schedule | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.mod = mod
        self.name = name
        self.parent = parent
        self.group = group
        self.metadata = Metadata()
        self.child: dict[str, Schedule] = {}
        self._adopt_children()

    def _adopt_children(self, reuse: dict[int, Schedule] | None = None) -> None:
        """(Re)build the child nodes from ``self.mod``; modules found in ``reuse`` (by identity) keep
        their existing node, and with it everything the primitives recorded there."""
        reuse = reuse or {}
        self.child = {}
        for name, module in self.mod.named_children():
            node = reuse.get(id(module))
            if node is None:
                node = Schedule(module, name, self, self.group)
            node.name, node.parent = name, self
            node.mod = module
            node._adopt_children(reuse)
            self.child[name] = node

    def _refresh_children(self) -> None:
        """Rebuild the child nodes after ``self.mod`` changed, keeping the nodes of surviving modules."""
        self._adopt_children({id(node.mod): node for _, node in self.named_schedules() if node is not self})

    # ----- tree -----------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Dotted path from the root ("" for the root itself)."""
        if self.parent is None:
            return ""
        return f"{self.parent.path}.{self.name}" if self.parent.path else self.name

    @property
    def root(self) -> Schedule:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    @property
    def world_size(self) -> int:
        """Size of the group this schedule shards over (1 when single-process)."""
        return group_size(self.group)

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    def __getitem__(self, path: str | int) -> Schedule:
        node = self
        for part in str(path).split(".") if path != "" else []:
            if part not in node.child:
                raise KeyError(self._unknown_path_message(str(path)))
            node = node.child[part]
        return node

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
        except KeyError:
            return False
        return True

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """``(relative path, node)`` for this node and every descendant, parents first."""
        yield prefix, self
        for name, child in self.child.items():
            yield from child.named_schedules(f"{prefix}.{name}" if prefix else name)

    def explain(self) -> str:
        """What the primitives did to this module and those below it, a line a module (see
        :mod:`megatron_slapo.explain`): ``print(sch.explain())``."""
        return explain(self)

    def _unknown_path_message(self, path: str) -> str:
        known = [p for p, _ in self.named_schedules() if p]
        close = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
        where = f" under {self.path!r}" if self.path else ""
        hint = f"; closest existing paths: {', '.join(close)}" if close else ""
        return f"no submodule {path!r}{where}{hint}"

    # ----- tensors of this node's module --------------------------------------------------------
    def _tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer ``name`` held directly by this module."""
        for table in (self.mod._parameters, self.mod._buffers):
            if table.get(name) is not None:
                return table[name]
        have = [n for table in (self.mod._parameters, self.mod._buffers) for n, t in table.items() if t is not None]
        raise self._error(f"{type(self.mod).__name__} has no parameter or buffer {name!r} (it has: {have})")

    def _set_tensor(self, name: str, tensor: torch.Tensor) -> None:
        table = self.mod._parameters if name in self.mod._parameters else self.mod._buffers
        table[name] = tensor

    # ----- errors ---------------------------------------------------------------------------
    def _error(self, message: str, kind: type[Exception] = SchedulingError) -> Exception:
        """An exception whose message names this node's path."""
        where = self.path or "<root>"
        return kind(f"[{where}] {message}")

    def __repr__(self) -> str:
        return f"Schedule(path={self.path!r}, module={type(self.mod).__name__}, children={len(self.child)})"


def create_schedule(model: nn.Module, group: dist.ProcessGroup | None = None) -> Schedule:
    """Create the schedule tree of ``model``.

    ``group`` is the process group that ``shard``/``sync`` act over. By default it is the
    tensor-parallel group when :func:`megatron_slapo.parallel.initialize` has run, else the world
    group when torch.distributed is initialised, else none (single process).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_schedule expects an nn.Module, got {type(model).__name__}")
    return Schedule(model, group=group if group is not None else default_group())
