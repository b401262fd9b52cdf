"""``find``: locate subgraphs of traced modules, by module path or by the shape of a computation.

A *regex* matches ``call_module`` nodes by their path (``r"query|key|value"`` finds the three
projections of a BERT self-attention, which ``replace`` can then fuse horizontally). A *pattern*
is a function (or module) that is traced itself and matched against the graph node by node:

    def bias_gelu(x, bias):
        return F.gelu(x + bias, approximate="tanh")

Ops are compared by what they compute, not how they are spelled: ``F.gelu`` matches an
``nn.GELU`` (or HF ``GELUActivation``) module call, ``torch.add`` matches ``x + y`` and the
operands of ``+`` and ``*`` may come in either order. Constant arguments must be equal (``x - 1``
does not match ``1 - x``; a dropout pattern's ``p`` must be the layer's). Patterns may have several outputs (trees,
diamonds, parallel branches); every pattern input may bind to any node. Matches do not overlap.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from transformers import activations as hf_act
from transformers.pytorch_utils import Conv1D

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


@dataclass
class Subgraph:
    """Nodes of one traced graph found by ``find``, with the values flowing in and out."""

    owner: ScheduleNode  # the schedule node whose module is the GraphModule holding the nodes
    nodes: list[fx.Node]  # in graph order
    inputs: list[fx.Node]  # in the pattern's argument order
    outputs: list[fx.Node]  # in the pattern's output order
    bindings: dict[str, fx.Node] = field(default_factory=dict)  # pattern input name -> node

    @property
    def paths(self) -> list[str]:
        """Paths (relative to the owner) of the modules the subgraph calls."""
        return [n.target for n in self.nodes if n.op == "call_module"]

    def __repr__(self) -> str:
        ops = ", ".join(n.name for n in self.nodes)
        return f"Subgraph(owner={self.owner.path!r}, nodes=[{ops}])"


_MODULE_OPS: list[tuple[type, Callable[[nn.Module], str]]] = [
    (nn.GELU, lambda m: "gelu_tanh" if m.approximate == "tanh" else "gelu"),
    (hf_act.NewGELUActivation, lambda m: "gelu_tanh"),
    (hf_act.GELUTanh, lambda m: "gelu_tanh"),
    (hf_act.GELUActivation, lambda m: "gelu"),
    (nn.ReLU, lambda m: "relu"),
    (nn.SiLU, lambda m: "silu"),
    (nn.Tanh, lambda m: "tanh"),
    (nn.Dropout, lambda m: "dropout"),
    (nn.Softmax, lambda m: "softmax"),
    (nn.LayerNorm, lambda m: "layer_norm"),
    (nn.Linear, lambda m: "linear"),
    (Conv1D, lambda m: "conv1d"),
    (nn.Embedding, lambda m: "embedding"),
]

_FUNCTION_OPS: dict[Any, str] = {
    F.gelu: "gelu", F.relu: "relu", torch.relu: "relu", F.silu: "silu", torch.tanh: "tanh", F.tanh: "tanh",
    F.dropout: "dropout", F.softmax: "softmax", torch.softmax: "softmax", F.layer_norm: "layer_norm",
    operator.add: "add", torch.add: "add", operator.iadd: "add", operator.mul: "mul", torch.mul: "mul",
    operator.sub: "sub", torch.sub: "sub", operator.truediv: "div", torch.div: "div",
    operator.matmul: "matmul", torch.matmul: "matmul", F.linear: "linear", operator.getitem: "getitem",
}  # fmt: skip
_METHOD_OPS = {"add": "add", "add_": "add", "mul": "mul", "sub": "sub", "div": "div", "matmul": "matmul",
               "relu": "relu", "softmax": "softmax", "tanh": "tanh"}  # fmt: skip
_COMMUTATIVE = {"add", "mul"}


def op_key(node: fx.Node, owner: nn.Module | None) -> str:
    """What a node computes, independent of the functional / method / module spelling."""
    if node.op == "call_module":
        module = owner.get_submodule(node.target) if owner is not None else None
        for kind, key in _MODULE_OPS:
            if isinstance(module, kind):
                return key(module)
        return f"module:{type(module).__name__}"
    if node.op == "call_function":
        key = _FUNCTION_OPS.get(node.target)
        if key == "gelu" and node.kwargs.get("approximate") == "tanh":
            return "gelu_tanh"
        return key or f"function:{getattr(node.target, '__name__', node.target)}"
    if node.op == "call_method":
        return _METHOD_OPS.get(node.target, f"method:{node.target}")
    return node.op


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]


def _arg(node: fx.Node, position: int, name: str, default: Any) -> Any:
    return node.kwargs.get(name, node.args[position] if len(node.args) > position else default)


def normalized_args(node: fx.Node, owner: nn.Module, key: str) -> tuple[list, dict]:
    """The arguments that decide what a node computes, in one form for functional, method and module
    spellings: ``nn.Dropout(p)(x)`` and ``F.dropout(x, p, training=...)`` both become ``([x], {"p": p})``
    (the training flag is the mode, not the computation)."""
    module = owner.get_submodule(node.target) if node.op == "call_module" else None
    if key == "dropout":
        return [node.args[0]], {"p": module.p if module is not None else _arg(node, 1, "p", 0.5)}
    if key == "softmax":
        return [node.args[0]], {"dim": module.dim if module is not None else _arg(node, 1, "dim", None)}
    if key in ("gelu", "gelu_tanh", "relu", "silu", "tanh"):  # the variant is part of the key
        return [node.args[0] if node.args else next(iter(node.kwargs.values()))], {}
    return list(node.args), dict(node.kwargs)


class _Matcher:
    """Backtracking match of a pattern graph onto a target graph, anchored at the pattern outputs."""

    def __init__(self, pattern: fx.GraphModule, target: fx.GraphModule, taken: set[fx.Node]) -> None:
        self.pattern, self.target, self.taken = pattern, target, taken
        self.placeholders = [n for n in pattern.graph.nodes if n.op == "placeholder"]
        out = next(n for n in pattern.graph.nodes if n.op == "output").args[0]
        self.outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        self.order = {n: i for i, n in enumerate(target.graph.nodes)}

    def _match(self, p: fx.Node, t: fx.Node, env: dict[fx.Node, fx.Node]) -> dict | None:
        if p in env:
            return env if env[p] is t else None
        if p.op == "placeholder":
            return {**env, p: t}
        if t in self.taken or t in env.values() or t.op in ("placeholder", "get_attr", "output"):
            return None
        key = op_key(p, self.pattern)
        if key != op_key(t, self.target):
            return None
        p_args, p_kwargs = normalized_args(p, self.pattern, key)
        t_args, t_kwargs = normalized_args(t, self.target, key)
        if len(p_args) != len(t_args) or p_kwargs.keys() != t_kwargs.keys():
            return None
        orders = [t_args]
        if key in _COMMUTATIVE and len(t_args) == 2:
            orders.append(t_args[::-1])
        for candidate in orders:
            trial: dict | None = {**env, p: t}
            pairs = [*zip(p_args, candidate, strict=True), *((p_kwargs[k], t_kwargs[k]) for k in p_kwargs)]
            for pa, ta in pairs:
                trial = self._match_value(pa, ta, trial)
                if trial is None:
                    break
            if trial is not None:
                return trial
        return None

    def _match_value(self, pa: Any, ta: Any, env: dict) -> dict | None:
        """Nodes match recursively; constants (and containers of them) must be equal."""
        if isinstance(pa, fx.Node) and isinstance(ta, fx.Node):
            return self._match(pa, ta, env)
        if isinstance(pa, (tuple, list)) and isinstance(ta, (tuple, list)) and len(pa) == len(ta):
            for a, b in zip(pa, ta, strict=True):
                env = self._match_value(a, b, env)
                if env is None:
                    return None
            return env
        if isinstance(pa, fx.Node) or isinstance(ta, fx.Node):
            return None
        return env if pa == ta else None

    def _match_outputs(self, index: int, env: dict) -> dict | None:
        if index == len(self.outputs):
            return env
        p = self.outputs[index]
        candidates = [env[p]] if p in env else list(self.target.graph.nodes)
        for t in candidates:
            trial = self._match(p, t, env)
            if trial is not None:
                done = self._match_outputs(index + 1, trial)
                if done is not None:
                    return done
        return None

    def matches(self) -> Iterator[dict[fx.Node, fx.Node]]:
        while True:
            env = self._match_outputs(0, {})
            if env is None:
                return
            self.taken |= {t for p, t in env.items() if p.op != "placeholder"}
            yield env


def _traced_levels(sch: ScheduleNode) -> list[ScheduleNode]:
    levels = [node for _, node in sch.named_schedules() if isinstance(node.mod, fx.GraphModule)]
    if not levels:
        raise sch._error("find() searches traced graphs: trace() this module first")
    return levels


def find_regex(sch: ScheduleNode, regex: str | re.Pattern) -> list[Subgraph]:
    """Every ``call_module`` node (in this module's traced graphs) whose path matches ``regex``."""
    regex = re.compile(regex) if isinstance(regex, str) else regex
    found = []
    for level in _traced_levels(sch):
        prefix = level.path[len(sch.path) :].lstrip(".")
        for node in level.mod.graph.nodes:
            path = f"{prefix}.{node.target}" if prefix else str(node.target)
            if node.op == "call_module" and regex.search(path):
                inputs = _tensor_args(node)
                found.append(Subgraph(level, [node], inputs, [node]))
    return found


def find_pattern(sch: ScheduleNode, pattern: Callable | nn.Module) -> list[Subgraph]:
    """Every non-overlapping occurrence of ``pattern``'s computation in this module's traced graphs."""
    pattern_gm = fx.symbolic_trace(pattern)
    found = []
    for level in _traced_levels(sch):
        matcher = _Matcher(pattern_gm, level.mod, set())
        order = matcher.order
        for env in matcher.matches():
            nodes = sorted((t for p, t in env.items() if p.op != "placeholder"), key=order.__getitem__)
            inputs = [env[p] for p in matcher.placeholders]
            outputs = [env[p] for p in matcher.outputs]
            found.append(Subgraph(level, nodes, inputs, outputs, {p.target: env[p] for p in matcher.placeholders}))
    return found
