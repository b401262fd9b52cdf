"""Graph surgery on traced modules: extract a subgraph, splice a replacement in, inline a child graph.

These are the mechanics behind the static primitives (``replace(target_ops=...)``, ``fuse``,
``checkpoint(subgraph=...)``, ``decompose`` on a traced parent) and behind the pipeline
partitioner, kept apart from the primitives' argument checking.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_nn import (
    backward_hooks,
    backward_pre_hooks,
    forward_hooks,
    forward_pre_hooks,
    move_hooks,
    remove_forward_pre_hook,
)
from megatron_slapo.kernels.subgraph import SubgraphModule
from megatron_slapo.tracing import CallGuard
from megatron_slapo.tracing.module_shape import UNUSED

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


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
    if isinstance(callee, nn.Module):
        name = _free_name(owner, name)
        owner.add_submodule(name, callee)
        for old in _superseded_modules(owner, all_nodes) if not callee_runs_replaced else ():
            _drop_call_guards(old)  # the guard of a traced level checks calls that no longer happen
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


def _superseded_modules(owner: fx.GraphModule, nodes: Sequence[fx.Node]) -> list[nn.Module]:
    """The modules that ``nodes`` call and nothing else in ``owner`` calls (each once)."""
    inside = set(nodes)
    elsewhere = module_call_sites(owner, exclude=inside)
    targets = dict.fromkeys(str(n.target) for n in nodes if n.op == "call_module")
    return [owner.get_submodule(t) for t in targets if t not in elsewhere]


def _drop_call_guards(module: nn.Module) -> None:
    for key, hook in list(forward_pre_hooks(module).items()):
        if isinstance(hook, CallGuard):
            remove_forward_pre_hook(module, key)


def _hook_kinds(module: nn.Module) -> list[str]:
    """The kinds of user hooks ``module`` carries (a traced level's CallGuard is not one)."""
    counts = {
        "fwd_pre": sum(not isinstance(h, CallGuard) for h in forward_pre_hooks(module).values()),
        "fwd_post": len(forward_hooks(module)),
        "bwd_pre": len(backward_pre_hooks(module)),
        "bwd_post": len(backward_hooks(module)),
    }
    return [kind for kind, count in counts.items() if count]


def hooks_left_behind(owner: fx.GraphModule, groups: Sequence[tuple[Sequence[fx.Node], Sequence[fx.Node]]],
                      inputs: Sequence[fx.Node], callee_is_module: bool) -> str | None:  # fmt: skip
    """Why the hooks of the modules that ``splice`` would replace cannot move onto the callee.

    A hook moves only where it sees the same values on the callee: the pre-hooks (and the input side
    of backward hooks) of a layer called with exactly the callee's inputs, which nothing else in the
    subgraph reads; the post-hooks of the layer whose value is the subgraph's single output (a
    forward hook's ``args`` are then the callee's inputs). Anything else would run on other tensors,
    as would hooks of a layer still called elsewhere or replaced horizontally, or by a function.
    """
    nodes = [n for group, _ in groups for n in group]
    elsewhere = module_call_sites(owner, exclude=set(nodes))
    for node in nodes:
        if node.op != "call_module":
            continue
        kinds = _hook_kinds(owner.get_submodule(node.target))
        if not kinds:
            continue
        hooks = f"the {'/'.join(kinds)} hook(s) of {node.target}"
        if str(node.target) in elsewhere:
            return f"{hooks} would leave its calls outside the subgraph"
        if not callee_is_module:
            return f"{hooks} cannot move onto a function: replace with an nn.Module"
        if len(groups) > 1:
            return f"{hooks} would run once for every branch of a horizontal replacement, on all their values"
        others = [n for n in nodes if n is not node]
        sees_inputs = (tuple(node.args) == tuple(inputs) and not node.kwargs
                       and not any(set(n.all_input_nodes) & set(inputs) for n in others))  # fmt: skip
        sees_output = list(groups[0][1]) == [node]
        seen = {"fwd_pre": sees_inputs, "fwd_post": sees_output, "bwd_pre": sees_output,
                "bwd_post": sees_inputs and sees_output}  # fmt: skip
        wrong = [kind for kind in kinds if not seen[kind]]
        if wrong:
            return (
                f"the {'/'.join(wrong)} hook(s) of {node.target} would run on the replacement and see other "
                f"tensors than {node.target}'s (only pre-hooks of a layer that alone reads the subgraph's inputs "
                "and post-hooks of the layer producing its output can move)"
            )
    return None


def targets_in_use(owner: fx.GraphModule) -> set[str]:
    """Module/attribute paths the owner's graph or its subgraph modules still use."""
    used = {str(n.target) for n in owner.graph.nodes if n.op in ("call_module", "get_attr")}
    for child in owner.children():
        if isinstance(child, SubgraphModule):
            used |= child.targets()
    return used


def module_call_sites(owner: fx.GraphModule, exclude: set[fx.Node] = frozenset()) -> set[str]:
    """Owner-relative paths of the modules that the owner's graph (or a subgraph module of it) calls,
    not counting the nodes in ``exclude``."""
    sites = {str(n.target) for n in owner.graph.nodes if n.op == "call_module" and n not in exclude}
    for child in owner.children():
        if isinstance(child, SubgraphModule):
            sites |= {str(n.target) for n in child.graph.graph.nodes if n.op == "call_module"}
    return sites


def why_never_called(node: ScheduleNode) -> str | None:
    """Why ``node``'s module is never called as a module when the model runs, or ``None``.

    Below a traced level, a module runs only if that level's graph calls it (or calls an untraced
    module that contains it). A layer that was traced through (``decompose()``d, or inlined by
    ``flatten=True``) left only its ops in the graph: hooks on it, and anything built on hooks,
    would silently never run. Untraced levels are not checked: their Python forward is opaque; nor
    are children the original forward never used (tracing keeps them, see ``module_shape``).
    """
    current = node
    while current.parent is not None:
        owner = current.parent
        while owner is not None and not isinstance(owner.mod, fx.GraphModule):
            owner = owner.parent
        if owner is None:
            return None
        relative = current.path[len(owner.path) :].lstrip(".")
        parts = relative.split(".")
        if parts[0] in getattr(owner.mod, UNUSED, ()):
            return None  # the original forward never used it either: nothing it did is lost
        sites = module_call_sites(owner.mod)
        if not any(".".join(parts[:i]) in sites for i in range(1, len(parts) + 1)):
            return (
                f"the traced graph of {owner.path or '<root>'} does not call {relative} as a module (its ops were "
                "traced into that graph, as after decompose() or with flatten=True), so it would never run"
            )
        current = owner
    return None


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
    extra_hooks = [h for h in forward_pre_hooks(child).values() if not isinstance(h, CallGuard)]
    if extra_hooks or forward_hooks(child):
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
