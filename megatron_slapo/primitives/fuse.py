"""``fuse`` and ``decompose``: kernel-level rewrites of traced graphs.

``decompose()`` splits a Linear (or HF Conv1D) into ``matmul`` and a separate ``+ bias``, so that
the bias add and what follows (GeLU, dropout + residual add) form one pattern; ``fuse(subgraph)``
then compiles such a vertical subgraph with torch.compile into one kernel.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from megatron_slapo.compat.torch_nn import forward_hooks, forward_pre_hooks
from megatron_slapo.graph_edit import check_vertical, extract, splice
from megatron_slapo.kernels.compiled import CompiledSubgraph
from megatron_slapo.kernels.linear import DecomposedConv1D, DecomposedLinear
from megatron_slapo.pattern import Subgraph
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class FuseMixin:
    @primitive
    def fuse(self: ScheduleNode, subgraph: Subgraph, compiler: str = "inductor", name: str = "fused") -> None:
        """Compile one vertical subgraph (from ``find``) with torch.compile and splice it in as a module."""
        if not isinstance(subgraph, Subgraph):
            raise self._error("fuse() takes one Subgraph from find()", TypeError)
        problem = check_vertical(subgraph.nodes, subgraph.outputs)
        if problem:
            raise subgraph.owner._error(f"cannot fuse {subgraph}: {problem}")
        owner = subgraph.owner
        graph = extract(owner.mod, subgraph.nodes, subgraph.inputs, subgraph.outputs, name)
        callee = CompiledSubgraph(graph, compiler)
        group = [(subgraph.nodes, subgraph.outputs)]
        try:
            splice(owner.mod, group, subgraph.inputs, callee, name, callee_runs_replaced=True)
        except ValueError as e:
            raise owner._error(str(e)) from e
        owner._refresh_children()

    @primitive
    def decompose(self: ScheduleNode) -> None:
        """Split this Linear / HF Conv1D into a matmul and a separate bias add (to fuse the bias with what follows)."""
        mod = self.mod
        if type(mod) not in (nn.Linear, Conv1D):
            raise self._error(f"decompose() applies to nn.Linear or HF Conv1D, not {type(mod).__name__}")
        if getattr(mod, "bias", None) is None:
            raise self._error("decompose() separates the bias add, and this layer has no bias")
        owner = self.parent
        while owner is not None and not isinstance(owner.mod, fx.GraphModule):
            owner = owner.parent
        node = None
        if owner is not None:
            target = self.path[len(owner.path) :].lstrip(".")
            node = next((n for n in owner.mod.graph.nodes if n.op == "call_module" and n.target == target), None)
        if node is not None:
            meta = self.metadata
            if meta.shards or meta.syncs or forward_hooks(mod) or forward_pre_hooks(mod) or mod.__dict__.get("forward"):
                raise self._error("decompose() on a traced layer rewrites it as ops and would drop its shards, syncs "
                                  "and hooks: decompose it before tracing")  # fmt: skip
            _decompose_in_graph(owner.mod, node, mod)
            return
        if isinstance(mod, nn.Linear):
            new = DecomposedLinear(mod.in_features, mod.out_features, device="meta")
        else:
            with torch.device("meta"):  # its tensors are taken over from mod
                new = DecomposedConv1D(mod.nf, mod.nx)
        self.replace(new)  # same parameters (by name), now traced through when the parent is traced


def _decompose_in_graph(gm: fx.GraphModule, node: fx.Node, mod: nn.Module) -> None:
    """Rewrite ``call_module(linear)(x)`` as ``matmul(x, W) + b`` in an already traced graph."""
    graph, (x,) = gm.graph, node.args[:1]
    with graph.inserting_before(node):
        weight = graph.get_attr(f"{node.target}.weight")
        bias = graph.get_attr(f"{node.target}.bias")
        if isinstance(mod, nn.Linear):
            product = graph.call_function(F.linear, (x, weight))
        else:
            product = graph.call_function(torch.matmul, (x, weight))
        result = graph.call_function(operator.add, (product, bias))
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    gm.recompile()
