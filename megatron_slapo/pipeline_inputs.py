"""Which values of a flat model graph derive from the model's inputs alone, and so can be recomputed.

Megatron's pipeline schedules send one activation between stages and hand every stage the
micro-batch, so a value computed from the inputs alone (attention masks, position ids, Llama's
rotary ``cos``/``sin``) is recomputed by each stage that needs it instead of crossing the cut.

The rule is an ancestry rule over the graph, not a list of model families. A node is
*input-derived* when it is

- a placeholder (a model input), or a read of a tensor's ``device`` / ``dtype`` (whatever the
  tensor: a recomputing stage reads them from a stand-in of the same device and dtype);
- a ``get_attr`` of anything but a parameter (a buffer such as ``inv_freq``, a constant);
- a function or method call, not a random one, whose inputs are all input-derived;
- a module call that reads no parameter, uses no randomness, and whose result depends on nothing
  but input-derived values. To see what a module reads, its graph is read: a traced module's own,
  or for an untraced one a plain ``torch.fx`` trace made only for reading (the stages still call the
  module itself); a module fx cannot follow, a built-in layer, or one whose forward a primitive
  rewrote is opaque, and all its inputs must then be input-derived. An argument that the graph only
  reads the ``device`` / ``dtype`` of may be any activation: Llama's rotary embedding is called with
  the hidden states but reads only their device and dtype, besides ``position_ids`` and its
  ``inv_freq`` buffer. A recomputing stage passes such an argument a *stand-in*: its received
  activation (same device; activations share one dtype), or, for a traced module whose guard
  checks the argument, an uninitialised tensor of the shape and dtype the guard records (it refuses
  anything else, so the original argument had exactly those) on that activation's device.

Random ops (dropout, ``torch.rand``...) never count: recomputing them would draw new values.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_nn import DropoutNd, forward_pre_hooks
from megatron_slapo.kernels.subgraph import SubgraphModule
from megatron_slapo.tracing import CallGuard, is_builtin_leaf, meta_copy

_METADATA = ("device", "dtype")  # reading these from a tensor does not depend on its values
_RANDOM_FUNCTIONS = {
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like, torch.randperm,
    torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.dropout, torch.nn.functional.dropout,
    torch.nn.functional.dropout1d, torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
}  # fmt: skip
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "cauchy_", "log_normal_"}  # fmt: skip
StandIn = tuple[tuple[int, ...], torch.dtype]  # the shape and dtype of a module argument only its metadata is read of


def metadata_read(node: fx.Node) -> bool:
    """``getattr(x, "device")`` or ``getattr(x, "dtype")``: depends on where ``x`` lives, not on its values."""
    return node.op == "call_function" and node.target is getattr and node.args[1] in _METADATA


@dataclass
class Derivation:
    """The input-derived nodes of a graph, and the stand-ins their recomputation needs.

    ``stand_ins[(call, arg)]`` is set when the module call ``call`` is input-derived although its
    argument ``arg`` is not (the module reads only its device and dtype).
    """

    nodes: set[fx.Node] = field(default_factory=set)
    stand_ins: dict[tuple[fx.Node, fx.Node], StandIn] = field(default_factory=dict)

    def __contains__(self, node: object) -> bool:
        return node in self.nodes


def input_derived(gm: fx.GraphModule, sources: set[fx.Node] | None = None) -> Derivation:
    """The nodes of ``gm``'s graph computable from ``sources`` (default: all its placeholders) alone."""
    params = {id(p) for p in gm.parameters()}
    found = Derivation()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            derived = sources is None or node in sources
        elif metadata_read(node):
            derived = True
        elif node.op == "get_attr":
            derived = id(_attribute(gm, node.target)) not in params
        elif node.op in ("call_function", "call_method"):
            derived = not _random(node) and all(a in found for a in node.all_input_nodes)
        elif node.op == "call_module":
            derived = _module_derived(gm, node, found)
        else:
            derived = False
        if derived:
            found.nodes.add(node)
    return found


def _random(node: fx.Node) -> bool:
    return node.target in _RANDOM_METHODS if node.op == "call_method" else node.target in _RANDOM_FUNCTIONS


def _module_derived(owner: fx.GraphModule, node: fx.Node, found: Derivation) -> bool:
    """Whether the module call ``node`` depends on input-derived values only; records its stand-ins."""
    module = owner.get_submodule(node.target)
    if isinstance(module, (SubgraphModule, DropoutNd)):
        return False  # a subgraph calls its owner's layers (weights it does not hold); dropout is random
    if next(module.parameters(), None) is not None:
        return False
    given = _arguments(module, node)
    constants = {name: v for name, v in given.items() if isinstance(v, (str, int, float, bool))}
    graph = _analysis_graph(module, constants)
    if graph is None:  # opaque: every input must be input-derived
        return all(a in found for a in node.all_input_nodes)
    placeholders = [p for p in graph.graph.nodes if p.op == "placeholder"]
    inner = input_derived(graph, {p for p in placeholders if _all_derived(given.get(p.target), found)})
    output = next(n for n in graph.graph.nodes if n.op == "output")
    if not all(a in inner for a in output.all_input_nodes):
        return False
    names, stand_ins = {p.target for p in placeholders}, {}
    for name, value in given.items():
        if _all_derived(value, found):
            continue
        # Not input-derived, yet the result does not depend on it: the module reads only its metadata.
        if not isinstance(value, fx.Node) or name not in names:
            return False
        stand_ins[(node, value)] = _guarded_input(module, name)
        if isinstance(module, fx.GraphModule) and stand_ins[(node, value)] is None:
            return False  # its guard checks the argument, and records nothing a stand-in could copy
    found.stand_ins.update({k: v for k, v in stand_ins.items() if v is not None})
    return True


def _arguments(module: nn.Module, node: fx.Node) -> dict[str, Any]:
    """The call's arguments by the names of ``module``'s forward (positional ones matched in order)."""
    if isinstance(module, fx.GraphModule):
        names = [p.target for p in module.graph.nodes if p.op == "placeholder"]
    else:
        names = [p for p in inspect.signature(module.forward).parameters]
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _analysis_graph(module: nn.Module, constants: dict[str, Any]) -> fx.GraphModule | None:
    """A graph of what ``module`` computes, to see what it reads; ``None`` if it has none (opaque).

    A traced module is its own graph. An untraced one is traced here with plain ``torch.fx``, only to
    be read (the stages still call the module): a meta copy is traced, so a forward that assigns
    attributes cannot alter the model, and a forward fx cannot follow (data-dependent branches,
    ``*args``) leaves the module opaque. The call's ``constants`` (Gemma 3's rotary embedding takes
    the layer type, a string it builds attribute names from) are traced as the values they are. A
    forward a primitive rewrote (``PatchedForward``) or a built-in layer is opaque too.
    """
    if "forward" in module.__dict__ or is_builtin_leaf(module):
        return None
    if isinstance(module, fx.GraphModule):
        return module
    try:
        return fx.symbolic_trace(meta_copy(module), concrete_args=constants or None)
    except Exception:  # noqa: BLE001 - whatever stops fx, the module stays opaque (the safe answer)
        return None


def _all_derived(value: Any, found: Derivation) -> bool:
    nodes: list[fx.Node] = []
    fx.node.map_arg(value, nodes.append)
    return all(n in found for n in nodes)


def _guarded_input(module: nn.Module, name: str) -> StandIn | None:
    """The ``(shape, dtype)`` the module's trace guard accepts for tensor input ``name``, if it records one."""
    for hook in forward_pre_hooks(module).values():
        if isinstance(hook, CallGuard):
            described = hook.inputs.get(name)
            if isinstance(described, tuple) and len(described) == 2 and isinstance(described[1], torch.dtype):
                return described
    return None


def stand_in(graph: fx.Graph, anchor: fx.Node, described: StandIn) -> fx.Node:
    """Nodes making an uninitialised ``(shape, dtype)`` tensor on ``anchor``'s device, without allocating it whole."""
    shape, dtype = described
    device = graph.call_function(getattr, (anchor, "device"))
    scalar = graph.call_function(torch.empty, ((),), {"dtype": dtype, "device": device})
    return graph.call_method("expand", (scalar, *shape))


def _attribute(root: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)
