"""Graph surgery on traced modules: extract a subgraph, splice a replacement in, inline a child graph.

These are the mechanics behind the static primitives (``replace(target_ops=...)``, ``fuse``,
``checkpoint(subgraph=...)``, ``decompose`` on a traced parent) and behind the pipeline
partitioner, kept apart from the primitives' argument checking.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from megatron_slapo.kernels.subgraph import SubgraphModule
from megatron_slapo.module_surgery import move_hooks
from megatron_slapo.tracing import CallGuard


def graph_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def external_users(nodes: Sequence[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """For each node, its users outside ``nodes``."""
    inside = set(nodes)
    return {n: [u for u in n.users if u not in inside] for n in nodes}


def check_vertical(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> str | None:
    """Why ``nodes`` is not one vertical piece (single output, nothing leaving and coming back)."""
    leaving = [n for n, users in external_users(nodes).items() if users]
    if len(outputs) != 1 or any(n is not outputs[0] for n in leaving):
        names = [n.name for n in leaving] or [n.name for n in outputs]
        return f"it has {len(set(names))} outputs ({', '.join(names)}); only single-output (vertical) subgraphs fit"
    return check_convex(nodes)


def check_convex(nodes: Sequence[fx.Node]) -> str | None:
    """Why ``nodes`` cannot be replaced by one call: a path that leaves them and comes back."""
    inside, order = set(nodes), graph_order(nodes[0].graph)
    first = min(order[n] for n in nodes)
    for n in nodes:  # no path out of the subgraph and back in
        for arg in n.all_input_nodes:
            if arg not in inside and order[arg] > first and _reaches_from(arg, inside):
                return f"{arg.name} lies between its nodes but outside it"
    return None


def _reaches_from(node: fx.Node, sources: set[fx.Node]) -> bool:
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return False


def extract(owner: fx.GraphModule, nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node],
            name: str = "Subgraph") -> fx.GraphModule:  # fmt: skip
    """A GraphModule computing ``outputs`` from ``inputs`` with the same ops (and the owner's weights)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"input_{i}")  # one node may bind two pattern inputs: names by position
    for node in sorted(nodes, key=graph_order(owner.graph).__getitem__):
        env[node] = graph.node_copy(node, lambda n: env[n] if n in env else _copy_attr(graph, n, env))
    graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return fx.GraphModule(owner, graph, name)


def _copy_attr(graph: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    if node.op != "get_attr":
        raise ValueError(f"{node.name} feeds the subgraph but is not one of its inputs")
    env[node] = graph.get_attr(node.target)
    return env[node]


def splice(owner: fx.GraphModule, groups: Sequence[tuple[Sequence[fx.Node], Sequence[fx.Node]]],
           inputs: Sequence[fx.Node], callee: nn.Module | Callable, name: str,
           callee_runs_replaced: bool = False) -> str:  # fmt: skip
    """Replace each group ``(nodes, outputs)`` by one call ``callee(*inputs)``.

    With one group, the call's value (or its items, for several outputs) stands for the outputs;
    with several groups (horizontal), item ``i`` of the call's value stands for group ``i``'s output.
    A module callee is registered on ``owner`` under a free name derived from ``name``. If the
    callee supersedes the replaced modules, their hooks move onto it and they are removed; if it
    runs them itself (``callee_runs_replaced``: a compiled or checkpointed copy of the subgraph),
    they stay registered where they are (same names, reached by ``.train()`` and ``.to()``).
    Returns the name the callee got.
    """
    graph = owner.graph
    order = graph_order(graph)
    all_nodes = [n for nodes, _ in groups for n in nodes]
    for nodes, _ in groups:  # check everything before changing anything
        problem = check_convex(nodes)
        if problem:
            raise ValueError(f"cannot replace {[n.name for n in nodes]}: {problem}")
    anchor = min(all_nodes, key=order.__getitem__)
    if any(order[i] > order[anchor] for i in inputs):
        users = [u for _, outs in groups for o in outs for u in o.users if u not in all_nodes]
        anchor = min(users, key=order.__getitem__)
    replaced_modules = [owner.get_submodule(n.target) for n in all_nodes if n.op == "call_module"]
    if isinstance(callee, nn.Module):
        name = _free_name(owner, name)
        owner.add_submodule(name, callee)
        for old in replaced_modules if not callee_runs_replaced else ():
            move_hooks(old, callee)
    with graph.inserting_before(anchor):
        if isinstance(callee, nn.Module):
            call = graph.call_module(name, tuple(inputs))
        else:
            call = graph.call_function(callee, tuple(inputs))
        results: list[Any] = []
        several = len(groups) > 1 or len(groups[0][1]) > 1
        outputs = [o for _, outs in groups for o in outs]
        for i, _ in enumerate(outputs):
            results.append(graph.call_function(operator.getitem, (call, i)) if several else call)
    for old, new in zip(outputs, results, strict=True):
        old.replace_all_uses_with(new)
    for node in sorted(all_nodes, key=order.__getitem__, reverse=True):
        graph.erase_node(node)
    graph.lint()
    if not callee_runs_replaced:
        used = targets_in_use(owner)
        for target in {n.target for n in all_nodes if n.op == "call_module"} - used:
            owner.delete_submodule(target)
    owner.recompile()
    return name


def targets_in_use(owner: fx.GraphModule) -> set[str]:
    """Module/attribute paths the owner's graph or its subgraph modules still use."""
    used = {str(n.target) for n in owner.graph.nodes if n.op in ("call_module", "get_attr")}
    for child in owner.children():
        if isinstance(child, SubgraphModule):
            used |= child.targets()
    return used


def _free_name(owner: nn.Module, name: str) -> str:
    base, i = name.replace(".", "_"), 0
    candidate = base
    while hasattr(owner, candidate):
        i += 1
        candidate = f"{base}_{i}"
    return candidate


def inline(parent: fx.GraphModule, node: fx.Node) -> None:
    """Replace a ``call_module`` of a child GraphModule by the child's own nodes."""
    child = parent.get_submodule(node.target)
    if not isinstance(child, fx.GraphModule):
        raise TypeError(f"{node.target} is not a traced module")
    if child.meta.get("slapo_train_only"):
        raise ValueError(f"{node.target} is traced for train mode only and cannot be inlined")
    extra_hooks = [h for h in child._forward_pre_hooks.values() if not isinstance(h, CallGuard)]
    if extra_hooks or child._forward_hooks:
        raise ValueError(f"{node.target} has forward hooks, which inlining would drop")
    graph = parent.graph
    given = dict(zip([p.target for p in child.graph.nodes if p.op == "placeholder"], node.args, strict=False))
    given.update(node.kwargs)
    env: dict[fx.Node, Any] = {}
    with graph.inserting_before(node):
        for cnode in child.graph.nodes:
            if cnode.op == "placeholder":
                env[cnode] = given.get(cnode.target)
            elif cnode.op == "output":
                result = fx.node.map_arg(cnode.args[0], lambda n: env[n])
            else:
                copied = graph.node_copy(cnode, lambda n: env[n])
                mode_switch = copied.op == "get_attr" and copied.target == "training"  # reads the new runner
                if copied.op in ("call_module", "get_attr") and not mode_switch:
                    copied.target = f"{node.target}.{copied.target}"
                env[cnode] = copied
    _replace_structured(node, result)
    graph.erase_node(node)


def _replace_structured(node: fx.Node, value: Any) -> None:
    """Point the users of ``node`` at ``value``; ``node[i]`` users at the matching item of a tuple value."""
    if isinstance(value, fx.Node):
        node.replace_all_uses_with(value)
        return
    for user in list(node.users):
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(value, (tuple, list))):
            raise NotImplementedError(f"cannot inline {node.target}: its {type(value).__name__} output is used whole")
        item = value[user.args[1]]
        if isinstance(item, fx.Node):
            user.replace_all_uses_with(item)
        else:  # a constant item (e.g. attention weights None): substitute it where it is used
            for consumer in list(user.users):
                consumer.args = fx.node.map_arg(consumer.args, lambda n, u=user, v=item: v if n is u else n)
                consumer.kwargs = fx.node.map_arg(consumer.kwargs, lambda n, u=user, v=item: v if n is u else n)
        user.graph.erase_node(user)
