"""The schedule tree without its primitives: one node per submodule, addressed by dotted path.

:class:`ScheduleNode` is what every layer below the primitives needs of a schedule (graph edits,
pattern matching, ``explain``, the primitives themselves): the module, its path, its parent and
children, the process group it shards over, and what the primitives recorded (:class:`Metadata`).
:class:`~megatron_slapo.schedule.Schedule` adds the primitives to it as mixins.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.compat.torch_nn import own_tensor_tables
from megatron_slapo.errors import SchedulingError
from megatron_slapo.metadata import Metadata
from megatron_slapo.parallel.collectives import group_rank, group_size


class ScheduleNode:
    """A node of the schedule tree; see :func:`~megatron_slapo.schedule.create_schedule`."""

    def __init__(
        self,
        mod: nn.Module,
        name: str = "",
        parent: ScheduleNode | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.mod = mod
        self.name = name
        self.parent = parent
        self.group = group
        self.metadata = Metadata()
        self.child: dict[str, ScheduleNode] = {}
        self._adopt_children()

    def _adopt_children(self, reuse: dict[int, ScheduleNode] | None = None) -> None:
        """(Re)build the child nodes from ``self.mod``; modules found in ``reuse`` (by identity) keep
        their existing node, and with it everything the primitives recorded there."""
        reuse = reuse or {}
        self.child = {}
        for name, module in self.mod.named_children():
            node = reuse.get(id(module))
            if node is None:
                node = type(self)(module, name, self, self.group)
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
    def root(self) -> ScheduleNode:
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

    def __getitem__(self, path: str | int) -> ScheduleNode:
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

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, ScheduleNode]]:
        """``(relative path, node)`` for this node and every descendant, parents first."""
        yield prefix, self
        for name, child in self.child.items():
            yield from child.named_schedules(f"{prefix}.{name}" if prefix else name)

    def _unknown_path_message(self, path: str) -> str:
        known = [p for p, _ in self.named_schedules() if p]
        close = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
        where = f" under {self.path!r}" if self.path else ""
        hint = f"; closest existing paths: {', '.join(close)}" if close else ""
        return f"no submodule {path!r}{where}{hint}"

    # ----- tensors of this node's module --------------------------------------------------------
    def _tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer ``name`` held directly by this module."""
        for table in own_tensor_tables(self.mod):
            if table.get(name) is not None:
                return table[name]
        have = [n for table in own_tensor_tables(self.mod) for n, t in table.items() if t is not None]
        raise self._error(f"{type(self.mod).__name__} has no parameter or buffer {name!r} (it has: {have})")

    def _set_tensor(self, name: str, tensor: torch.Tensor) -> None:
        parameters, buffers = own_tensor_tables(self.mod)
        (parameters if name in parameters else buffers)[name] = tensor

    # ----- errors ---------------------------------------------------------------------------
    def _error(self, message: str, kind: type[Exception] = SchedulingError) -> Exception:
        """An exception whose message names this node's path."""
        where = self.path or "<root>"
        return kind(f"[{where}] {message}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, module={type(self.mod).__name__}, children={len(self.child)})"
        )
