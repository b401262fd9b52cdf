"""``replace`` and ``replace_all``: swap a submodule for another implementation.

The replacement inherits what the old module had: parameters and buffers under the same name and
shape are moved over as the *same* tensor objects (so pretrained weights and weight ties survive,
which Slapo's schedules lost), and forward/backward hooks (including those installed by ``sync``
and ``hook``) move with them. Replace first, then shard/checkpoint: a replaced module starts
unsharded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from megatron_slapo.compat.torch_nn import move_hooks, own_tensor_tables
from megatron_slapo.graph_edit import external_users, hooks_left_behind, splice
from megatron_slapo.pattern import Subgraph
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class FunctionModule(nn.Module):
    """Wraps a plain function so it can stand in the module tree (``replace(F.gelu)``)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def _move_tensors(old: nn.Module, new: nn.Module) -> list[str]:
    """Give ``new`` the very tensors of ``old`` wherever name and shape agree; return mismatches."""
    mismatched = []
    new_modules = dict(new.named_modules())
    for prefix, old_owner in old.named_modules():
        new_owner = new_modules.get(prefix)
        if new_owner is None:
            continue
        for old_table, new_table in zip(own_tensor_tables(old_owner), own_tensor_tables(new_owner), strict=True):
            for name, tensor in old_table.items():
                target = new_table.get(name)
                if tensor is None or target is None:
                    continue
                if target.shape != tensor.shape:
                    mismatched.append(
                        f"{prefix + '.' if prefix else ''}{name}: {tuple(tensor.shape)} -> {tuple(target.shape)}"
                    )
                else:
                    new_table[name] = tensor
    return mismatched


def _arity_problem(callee: nn.Module | Callable[..., Any], n_inputs: int) -> str | None:
    """Why ``callee`` cannot be called with the subgraph's ``n_inputs`` positional inputs, or ``None``."""
    fn = callee.forward if isinstance(callee, nn.Module) else callee
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: checked when they run
        return None
    try:
        signature.bind(*range(n_inputs))
    except TypeError as e:
        what = type(callee).__name__ if isinstance(callee, nn.Module) else getattr(callee, "__name__", repr(callee))
        return f"it has {n_inputs} input(s), and {what}{signature} cannot take them ({e})"
    return None


class ReplaceMixin:
    @primitive
    def replace(
        self: ScheduleNode,
        new_module: nn.Module | Callable[..., Any],
        *,
        keep_weights: bool = True,
        target_ops: Subgraph | Sequence[Subgraph] | None = None,
        name: str | None = None,
    ) -> None:
        """Swap this module for ``new_module`` (or a function), keeping its weights and hooks; or, with ``target_ops``, swap subgraphs found by ``find``.

        Tensors whose name and shape match are taken over from the old module (the same objects,
        so ties and pretrained values are kept); a same-named tensor with another shape is an
        error unless ``keep_weights=False``. With ``target_ops`` one subgraph is replaced
        vertically (``new_module(*its inputs)`` stands for its output(s)); several single-output
        subgraphs sharing their inputs (q, k, v) are replaced horizontally by one call whose
        items stand for their outputs; its signature must take the subgraph's inputs, and a module
        takes the owner's train/eval mode. Hooks of replaced modules move to ``new_module`` where they
        see the same tensors (pre-hooks of the layer that alone reads the inputs, post-hooks of the
        layer producing the output); any other hook is refused (see ``hooks_left_behind``).
        """
        if target_ops is not None:
            self._replace_subgraphs(new_module, target_ops, name)
            return
        if self.parent is None:
            raise self._error("cannot replace the root module; pass the new model to create_schedule()")
        if not isinstance(new_module, nn.Module):
            if not callable(new_module):
                raise self._error(
                    f"replace() expects an nn.Module or a callable, got {type(new_module).__name__}",
                    TypeError,
                )
            new_module = FunctionModule(new_module)
        for path, node in self.named_schedules():
            meta = node.metadata
            done = [
                name
                for name, applied in (
                    ("shard", meta.shards),
                    ("checkpoint", meta.checkpointed),
                    ("fork_rng", meta.forked_rng),
                    ("compile", meta.compiled),
                )
                if applied
            ]
            if path:  # descendants disappear with the old module, and their syncs and tags with them
                done += [name for name, applied in (("sync", meta.syncs), ("annotate", meta.annotations)) if applied]
            if done:
                where = f"{self.path}.{path}" if path else self.path
                raise self._error(f"{where} already has {', '.join(done)}; apply replace() before those primitives")
        old = self.mod
        if keep_weights:
            mismatched = _move_tensors(old, new_module)
            if mismatched:
                raise self._error(
                    "the replacement has tensors of the same name but another shape: "
                    + "; ".join(mismatched)
                    + " (pass keep_weights=False to start them fresh)"
                )
        move_hooks(old, new_module)
        new_module.train(old.training)
        setattr(self.parent.mod, self.name, new_module)
        self.mod = new_module
        self.metadata.replaced = self.metadata.replaced or type(old).__name__  # the original, if replaced twice
        self._adopt_children()

    def _replace_subgraphs(self: ScheduleNode, callee: Any, target_ops: Any, name: str | None) -> None:
        groups = [target_ops] if isinstance(target_ops, Subgraph) else list(target_ops)
        if not groups or not all(isinstance(g, Subgraph) for g in groups):
            raise self._error("target_ops must be a Subgraph or a list of Subgraphs from find()", TypeError)
        if not (isinstance(callee, nn.Module) or callable(callee)):
            raise self._error(f"replace() expects an nn.Module or a callable, got {type(callee).__name__}", TypeError)
        owner = groups[0].owner
        if any(g.owner is not owner for g in groups):
            raise self._error("target_ops must all come from the same traced module")
        if len(groups) == 1:
            g = groups[0]
            leaking = [n.name for n, users in external_users(g.nodes).items() if users and n not in g.outputs]
            if leaking:
                raise owner._error(f"cannot replace the subgraph: {', '.join(leaking)} are also used outside it")
        else:
            if any(len(g.outputs) != 1 for g in groups):
                raise owner._error("a horizontal replace takes single-output subgraphs")
            if any(g.inputs != groups[0].inputs for g in groups):
                raise owner._error("a horizontal replace needs subgraphs that share their inputs (like q, k, v)")
        arity = _arity_problem(callee, len(groups[0].inputs))
        if arity:
            raise owner._error(f"cannot replace the subgraph: {arity}")
        hooks = hooks_left_behind(
            owner.mod, [(g.nodes, g.outputs) for g in groups], groups[0].inputs, isinstance(callee, nn.Module)
        )
        if hooks:
            raise owner._error(f"cannot replace the subgraph: {hooks}; replace() first, then hook the new module")
        label = name or (type(callee).__name__ if isinstance(callee, nn.Module) else callee.__name__).lower()
        try:
            splice(owner.mod, [(g.nodes, g.outputs) for g in groups], groups[0].inputs, callee, label)
        except ValueError as e:
            raise owner._error(str(e)) from e
        if isinstance(callee, nn.Module):
            callee.train(owner.mod.training)  # spliced into a model that may be in eval mode
        owner._refresh_children()

    @primitive
    def replace_all(
        self: ScheduleNode, module_type: type[nn.Module], make_fn: Callable[[str, nn.Module], nn.Module]
    ) -> list[str]:
        """Replace every submodule of ``module_type`` with ``make_fn(path, module)``; return the paths."""
        if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
            raise self._error(f"replace_all() expects an nn.Module subclass, got {module_type!r}", TypeError)
        replaced: list[str] = []
        for path, node in list(self.named_schedules()):
            if node is self or not isinstance(node.mod, module_type):
                continue
            if any(path.startswith(done + ".") for done in replaced):
                continue  # inside something already replaced
            node.replace(make_fn(node.path, node.mod))
            replaced.append(path)
        return [f"{self.path}.{p}" if self.path else p for p in replaced]
