"""A traced level's ``GraphModule`` keeps the shape of the module it was traced from.

fx builds a ``GraphModule`` from what the graph refers to: containers become plain ``Module``s,
layers traced through become stand-ins, unreferenced parameters vanish, every buffer turns
persistent and children are reordered. Schedules, ``build``, checkpoints and the trainer all look
at that shape (state-dict names, layer lists, initialisation order), so :func:`graph_module` puts
it back: tracing must not change what a model looks like from outside, only how it runs.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_nn import child_modules, non_persistent_buffers, own_buffers, own_parameters


def graph_module(module: nn.Module, graph: fx.Graph, constants: dict[str, Any]) -> fx.GraphModule:
    """The ``GraphModule`` running ``graph`` in place of ``module``, with ``module``'s shape;
    ``constants`` are tensors fx lifted out of the code (name -> value)."""
    gm = fx.GraphModule(_graph_root(module, graph, constants), graph, f"Traced{type(module).__name__}")
    _keep_unused_children(gm, module, graph)
    _keep_containers(gm, module)
    _keep_inlined_layers(gm, module)
    _keep_parameters(gm, module)
    _keep_buffer_persistence(gm, module)
    _keep_child_order(gm, module)
    return gm


def _graph_root(module: nn.Module, graph: fx.Graph, constants: dict[str, Any]) -> dict[str, Any]:
    """What the GraphModule is built from: what the graph refers to (:func:`_keep_parameters` adds the rest)."""
    root: dict[str, Any] = dict(constants)
    for node in graph.nodes:
        if node.op == "call_module":
            root[node.target] = module.get_submodule(node.target)
        elif node.op == "get_attr" and node.target not in constants:
            owner, _, name = node.target.rpartition(".")
            root[node.target] = getattr(module.get_submodule(owner) if owner else module, name)
    return root


UNUSED = "slapo_unused_children"  # the attribute listing them: graph_edit.why_never_called accepts them


def _keep_unused_children(gm: fx.GraphModule, module: nn.Module, graph: fx.Graph) -> None:
    """A child the forward never uses at all, neither calling it nor reading its tensors (T5's
    ``shared``, whose table each stack looks up through its own alias), stays a child: its
    tensors keep their state-dict names and the initialisation unit that gives them their values."""
    referenced = {str(n.target).split(".")[0] for n in graph.nodes if n.op in ("call_module", "get_attr")}
    children = child_modules(module)
    unused = [name for name in children if name not in referenced and name not in child_modules(gm)]
    for name in unused:
        gm.add_module(name, children[name])
    setattr(gm, UNUSED, frozenset(unused))


def _keep_containers(gm: fx.GraphModule, module: nn.Module) -> None:
    """A ``ModuleList`` of called layers stays a ``ModuleList`` (fx would rebuild it as a plain
    ``Module``): ``build`` initialises per layer, and the trainer finds the layers, by that type."""
    for name, container in module.named_modules():
        if not name or not isinstance(container, nn.ModuleList):
            continue
        owner_path, _, leaf = name.rpartition(".")
        try:
            rebuilt = gm.get_submodule(name)
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue  # the graph calls none of its layers
        layers = child_modules(container)
        if type(rebuilt) is nn.Module and all(c is layers.get(k) for k, c in child_modules(rebuilt).items()):
            setattr(owner, leaf, container)


def _keep_inlined_layers(gm: fx.GraphModule, module: nn.Module) -> None:
    """A layer traced through (``slapo_inline``, e.g. a decomposed Linear) stays itself in the
    GraphModule instead of fx's plain stand-in holding its tensors: ``shard`` still knows its
    placement, and ``build`` can refuse one whose placement the graph cannot honour."""
    for name, layer in module.named_modules():
        if not name or not getattr(layer, "slapo_inline", False):
            continue
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue
        if type(child_modules(owner).get(leaf)) is nn.Module:
            child_modules(owner)[leaf] = layer


def _keep_parameters(gm: fx.GraphModule, module: nn.Module) -> None:
    """Parameters the graph does not refer to keep their place too (a tied alias such as BERT's
    ``cls.predictions.bias`` keeps its state-dict name), wherever their owner is in the GraphModule."""
    for name, param in module.named_parameters(remove_duplicate=False):
        owner_path, _, leaf = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue  # a submodule the graph never calls
        if leaf not in own_parameters(owner):
            owner.register_parameter(leaf, param)


def _keep_buffer_persistence(gm: fx.GraphModule, module: nn.Module) -> None:
    """fx registers every buffer as persistent; those that were not (Llama's ``inv_freq``, BERT's
    ``position_ids``) stay out of the state dict, so checkpoint keys do not depend on tracing."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for leaf in non_persistent_buffers(owner):
            try:
                traced_owner = gm.get_submodule(prefix) if prefix else gm
            except AttributeError:
                continue  # a submodule the graph never calls
            if leaf in own_buffers(traced_owner):
                non_persistent_buffers(traced_owner).add(leaf)


def _keep_child_order(gm: fx.GraphModule, module: nn.Module) -> None:
    """Children keep the original module's order: fx registers them shallowest target first, but
    ``build`` initialises units in module order, and a tied weight takes the values of the first
    unit holding it (OPT's ``lm_head`` would otherwise initialise the embedding, padding row and all)."""
    for name, original in module.named_modules():
        try:
            rebuilt = gm.get_submodule(name) if name else gm
        except AttributeError:
            continue  # a submodule the graph never calls
        if rebuilt is not original:
            children = child_modules(rebuilt)
            for child in [c for c in child_modules(original) if c in children]:
                children[child] = children.pop(child)
