"""The module tree that ``build`` initialises: the model as it was before tracing.

``build`` defines initial values per unit, in post-order, by calling the model's initialiser (HF's
``_init_weights``) on each module. Tracing would change both: a traced level is a ``GraphModule``
(with ``flatten=True`` its sub-levels are plain ``nn.Module`` stand-ins) whose children are
registered in the order the graph first uses them, and whose class HF's ``_init_weights`` no longer
recognises (it dispatches on ``isinstance`` and class names: GPT-2's scaled ``c_proj``, GPT-Neo's
causal-mask buffer, rotary ``inv_freq``). Initial values would then depend on whether, and how, the
model was traced.

So every traced level that still had meta tensors remembers the module it was traced from
(``GraphModule.meta[ORIGINAL]``), and :func:`init_tree` maps the model onto those originals: the
original modules, in their own child order, stand for their traced levels. During initialisation
(:func:`originals_see_live`) each original's tensor slots and children point at the model's live
tensors and modules, so the initialiser writes exactly the tensors the model holds. Tensors of an
original that the traced model dropped (a module the graph never calls) are *phantoms*: they are
initialised too, so the random stream advances exactly as without tracing, and then discarded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_nn import child_modules, own_tensor_tables
from megatron_slapo.tracing.tracer import ORIGINAL


@dataclass
class InitNode:
    """One module as the initialiser sees it.

    ``live`` is the module in the model (``None`` for an original child the traced model dropped);
    ``init`` is what the initialiser is called on: the original module of a traced level, else
    ``live`` itself.
    """

    path: str
    live: nn.Module | None
    init: nn.Module
    children: list[InitNode] = field(default_factory=list)

    def modules(self) -> Iterator[InitNode]:
        """This node and its descendants, pre-order."""
        yield self
        for child in self.children:
            yield from child.modules()


def _original_of(live: nn.Module, candidate: nn.Module | None) -> nn.Module:
    """What stands for ``live`` in the initialiser's tree (see the module docstring)."""
    if isinstance(live, fx.GraphModule) and ORIGINAL in live.meta:
        return live.meta[ORIGINAL]
    stand_in = isinstance(live, fx.GraphModule) or type(live) is nn.Module  # made by tracing
    return candidate if stand_in and candidate is not None else live


def init_tree(live: nn.Module | None, path: str = "", candidate: nn.Module | None = None) -> InitNode:
    """The initialiser's tree for the model rooted at ``live`` (``candidate``: the original module
    at this path, known from an ancestor's original)."""
    init = _original_of(live, candidate) if live is not None else candidate
    node = InitNode(path, live, init)
    live_children = dict(live.named_children()) if live is not None else {}
    names = list(child_modules(init)) if init is not live else []
    names += [name for name in live_children if name not in names]  # modules spliced in after tracing last
    for name in names:
        original = child_modules(init).get(name) if init is not live else None
        child_live = live_children.get(name)
        if child_live is None and original is None:
            continue
        child_path = f"{path}.{name}" if path else name
        node.children.append(init_tree(child_live, child_path, original))
    return node


def _post_order(node: InitNode) -> Iterator[InitNode]:
    for child in node.children:
        yield from _post_order(child)
    yield node


def _has_container(node: InitNode) -> bool:
    return any(isinstance(n.init, nn.ModuleList | nn.ModuleDict) for n in node.modules())


def units(node: InitNode) -> Iterator[tuple[str, list[InitNode]]]:
    """Initialisation units in post-order: container-free subtrees, then each container's own tensors."""
    if not _has_container(node):
        yield node.path, list(_post_order(node))
        return
    for child in node.children:
        yield from units(child)
    yield node.path, [node]


@contextmanager
def originals_see_live(tree: InitNode) -> Iterator[None]:
    """Point each original's tensor slots (same name) and children at the live ones, and back after.

    Slots the live module does not have keep the original's tensor (a phantom, see the module
    docstring); tensors written into any slot while inside are dropped from the originals after.
    """
    saved: list[tuple[dict, dict]] = []
    try:
        for node in tree.modules():
            if node.live is None or node.init is node.live:
                continue
            for original, live in zip(own_tensor_tables(node.init), own_tensor_tables(node.live), strict=True):
                saved.append((original, dict(original)))
                for key in original:
                    if key in live:
                        original[key] = live[key]
            children = child_modules(node.init)
            saved.append((children, dict(children)))
            for child in node.children:
                name = child.path.rpartition(".")[2]
                if child.live is not None and name in children:
                    children[name] = child.init
        yield
    finally:
        for table, before in reversed(saved):
            table.clear()
            table.update(before)
