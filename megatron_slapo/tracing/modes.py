"""Train/eval mode: make traced graphs right in both, or refuse the mode they are not right in.

fx records Python decisions made at trace time, and HF attention decides dropout there:
``dropout_p = p if self.training else 0.0``. Every level is therefore traced in both modes; when the
two graphs differ only in dropout arguments, the train-mode graph gets a runtime switch on
``self.training``; any other difference marks the level train-only (its guard refuses eval calls).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_internals import SDPA_FUNCTIONS
from megatron_slapo.tracing.guard import Call
from megatron_slapo.tracing.tracer import Traced, install, trace_level


def dropout_p_when_training(training: bool, p: float) -> float:
    """Inserted in traced graphs: attention dropout applies only in training mode."""
    return p if training else 0.0


_DROPOUT = (torch.nn.functional.dropout,)


def _mode_blind(graph: fx.Graph) -> list[tuple]:
    """The graph with the dropout probabilities and flags that depend on train/eval mode masked out."""
    index = {node: i for i, node in enumerate(graph.nodes)}
    masked = {"dropout_p", "p", "training"}

    def norm(value: Any, key: str | None = None) -> Any:
        if key in masked:
            return "*"
        return fx.node.map_aggregate(value, lambda v: ("node", index[v]) if isinstance(v, fx.Node) else repr(v))

    sig = []
    for node in graph.nodes:
        dropout = node.op == "call_function" and node.target in SDPA_FUNCTIONS + _DROPOUT
        kwargs = {k: norm(v, k if dropout else None) for k, v in node.kwargs.items()}
        sig.append((node.op, _target_name(node.target), norm(node.args), kwargs))
    return sig


def _target_name(target: Any) -> str:
    # Stable across traces (MetaTracer wraps torch.arange & co. anew for every trace).
    if callable(target) and hasattr(target, "__qualname__"):
        return f"{getattr(target, '__module__', '')}.{target.__qualname__}"
    return str(target)


def _make_dropout_mode_aware(gm: fx.GraphModule) -> None:
    """Dropout in functional attention read ``self.training`` at trace time; read it at run time."""
    graph = gm.graph
    targets = [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA_FUNCTIONS + _DROPOUT]
    if not targets:
        return
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_placeholder):
        training = graph.create_node("get_attr", "training")  # a bool attribute: skip get_attr's tensor check
    for node in targets:
        with graph.inserting_before(node):
            if node.target in SDPA_FUNCTIONS and node.kwargs.get("dropout_p"):
                p = graph.call_function(dropout_p_when_training, (training, node.kwargs["dropout_p"]))
                node.kwargs = {**node.kwargs, "dropout_p": p}
            elif node.target in _DROPOUT and "training" in node.kwargs:
                node.kwargs = {**node.kwargs, "training": training}
    gm.recompile()


def reconcile_modes(train: Traced, evaluation: Traced) -> None:
    """Make ``train`` (traced in train mode) right in eval mode too, or mark it train-only.

    Levels whose eval-mode graph equals the train-mode one up to dropout get runtime dropout
    switches; any other mode-dependent branch leaves the level valid in train mode only (its guard
    refuses eval calls rather than compute something wrong).
    """
    if _mode_blind(train.module.graph) == _mode_blind(evaluation.module.graph):
        _make_dropout_mode_aware(train.module)
    else:
        train.module.meta["slapo_train_only"] = True
    for name, child in train.children.items():
        if name in evaluation.children:
            reconcile_modes(child, evaluation.children[name])
        else:
            child.module.meta["slapo_train_only"] = True


def trace_module(
    module: nn.Module,
    call: Call,
    path: str = "",
    flatten: bool = False,
    user_leaves: tuple[type, ...] = (),
    recursive: bool = True,
) -> Traced:
    """Trace in train mode and in eval mode, reconcile the two, install the child levels."""
    was_training = module.training
    try:
        module.train(True)
        train = trace_level(module, call, path, flatten, user_leaves)
        module.train(False)
        evaluation = trace_level(module, call, path, flatten, user_leaves)
    finally:
        module.train(was_training)
    reconcile_modes(train, evaluation)
    install(train, recursive)
    train.module.train(was_training)
    return train
