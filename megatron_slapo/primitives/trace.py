"""``trace``: turn a module (and, recursively, its children) into torch.fx graphs.

After ``sch["transformer.h.0"].trace(example_inputs=...)`` the block is a ``GraphModule`` whose
graph calls ``ln_1``, ``attn``, ``ln_2`` and ``mlp``; those children are traced too (each its own
level, ``recursive=True``), and ``sch["transformer.h.0.attn.c_attn"]`` still addresses the same
Conv1D, with whatever was scheduled on it. ``flatten=True`` inlines the children instead. See
:mod:`megatron_slapo.tracing` for how HF modules are made traceable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatron_slapo.compat.torch_nn import forward_hooks, forward_pre_hooks, move_hooks
from megatron_slapo.primitives.registry import primitive
from megatron_slapo.tracing import is_builtin_leaf, make_call, trace_module

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


def _example_call(module: nn.Module, example_inputs: Any, concrete_args: dict | None):
    if isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    else:
        args, kwargs = tuple(example_inputs), {}
    return make_call(module, args, {**kwargs, **(concrete_args or {})})


class TraceMixin:
    @primitive
    def trace(
        self: ScheduleNode,
        recursive: bool = True,
        flatten: bool = False,
        leaf_modules: Sequence[type[nn.Module]] = (),
        concrete_args: dict[str, Any] | None = None,
        example_inputs: Any = None,
    ) -> None:
        """Trace this module into a torch.fx GraphModule (one per level; ``flatten`` inlines children).

        ``example_inputs`` (a tensor, a tuple, or a dict by parameter name) fixes the input shapes the
        graph is specialised to; ``concrete_args`` are constants baked in (``use_cache=False``).
        Leaf layers and ``leaf_modules`` stay ``call_module`` nodes.
        """
        if self.metadata.traced:
            raise self._error("trace() is already applied to this module")
        if example_inputs is None:
            raise self._error("trace() needs example_inputs (a tensor, tuple, or dict of input name -> tensor)")
        self._check_traceable(tuple(leaf_modules))
        call = _example_call(self.mod, example_inputs, concrete_args)
        traced = trace_module(self.mod, call, self.path, flatten, tuple(leaf_modules), recursive)
        self._install_traced(traced.module)

    def _check_traceable(self: ScheduleNode, leaves: tuple[type, ...]) -> None:
        """Leaves stay as they are (shards, syncs and hooks included). A module that becomes a graph
        must not have been rewritten or hooked yet: its graph is traced from its plain forward."""
        for path, node in self.named_schedules():
            if is_builtin_leaf(node.mod) or isinstance(node.mod, leaves):
                continue
            meta = node.metadata
            done = [name for name, applied in (("checkpoint", meta.checkpointed), ("fork_rng", meta.forked_rng),
                                               ("shard", meta.shards), ("sync", meta.syncs)) if applied]  # fmt: skip
            if forward_hooks(node.mod) or forward_pre_hooks(node.mod):
                done.append("forward hooks")
            if done:
                where = path or "this module"
                raise self._error(f"{where} has {', '.join(dict.fromkeys(done))}; trace() before those primitives")

    def _install_traced(self: ScheduleNode, gm: nn.Module) -> None:
        reuse = {id(node.mod): node for _, node in self.named_schedules() if node is not self}
        annotations = {path: node.metadata.annotations for path, node in self.named_schedules()}
        move_hooks(self.mod, gm)
        if self.parent is not None:
            setattr(self.parent.mod, self.name, gm)
        self.mod = gm
        self._adopt_children(reuse)
        for path, node in self.named_schedules():
            if isinstance(node.mod, torch.fx.GraphModule):  # a new node for a level: keep its tags
                node.metadata.traced = True
                node.metadata.annotations = annotations.get(path, {})
