"""Materialising one initialisation unit: full-size CPU tensors, the model's initialiser, this rank's slices.

Used by :func:`megatron_slapo.build.build`, which defines the units and their seeds (see its
module docstring) on the tree of :mod:`megatron_slapo.init_tree`.

An initialiser may write a tensor any way it likes: ``nn.init.normal_(p)``, ``p.data.normal_()``,
``p.copy_(...)``, ``p.data = t``. A tensor it never wrote is an error (its values would be
garbage), so writes are observed where every one of them passes: in place ops are seen by a
``TorchDispatchMode`` (which ``.data`` aliases go through too, unlike the ``_version`` counter they
do not share), and a ``.data =`` assignment shows as a new storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatron_slapo.compat.torch_internals import TorchDispatchMode, op_schema
from megatron_slapo.compat.torch_nn import own_tensor_tables
from megatron_slapo.compat.transformers_internals import (
    holds_init_weights,
    init_weights,
    is_hf_initialized,
    mark_hf_initialized,
    unmark_hf_initialized,
)
from megatron_slapo.errors import SchedulingError
from megatron_slapo.init_tree import InitNode
from megatron_slapo.models.constructed import constructed_values
from megatron_slapo.parallel.layout import Stride, shard_slice

InitFn = Callable[[nn.Module], None]


class Slot:
    """One place that holds a tensor: ``table[key]`` of ``module`` (a live or original module)."""

    __slots__ = ("module", "table", "key", "tensor", "phantom")

    def __init__(self, module: nn.Module, table: dict, key: str, tensor: torch.Tensor, phantom: bool) -> None:
        self.module, self.table, self.key, self.tensor, self.phantom = module, table, key, tensor, phantom


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class WriteTracker(TorchDispatchMode):
    """Records the storages that operators write in place, whatever alias they were given."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(op_schema(func).arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    self.written.add(_storage(t))
        return func(*args, **kwargs)


def _derived(nodes: list[InitNode], work: set[int]) -> list[tuple[torch.Tensor, int, list[torch.Tensor]]]:
    """Tensors of this unit defined as the concatenation of others (a fused q|k|v projection: see
    ``param_origins`` in :mod:`megatron_slapo.kernels.qkv`), as ``(target, dim, sources)``.

    The original layers are still in the initialiser's tree (as phantoms when the graph no longer
    calls them), so they are initialised exactly as without fusion, and the fused tensor is their
    concatenation. Only where every source is at hand: in this unit, or already real.
    """
    derived = []
    for node in nodes:
        origins = getattr(node.init, "param_origins", None)
        for name, (dim, sources) in (origins() if callable(origins) else {}).items():
            owner, _, leaf = name.rpartition(".")
            target = getattr(node.init.get_submodule(owner) if owner else node.init, leaf)
            values = [getattr(module, key) for module, key in sources]
            if id(target) in work and all(id(v) in work or not v.is_meta for v in values):
                derived.append((target, dim, values))
    return derived


def _blank(shape: torch.Size, template: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh tensor for ``template``'s values: a CPU one whose floats start as NaN so partial writes
    show, or, for a model built on the meta device (a plan: ``tools/explain.py``), a meta one, which
    has no values to write and allocates nothing."""
    t = torch.empty(shape, dtype=template.dtype, device="meta" if device.type == "meta" else "cpu")
    if t.is_floating_point() and not t.is_meta:
        t.fill_(float("nan"))
    return nn.Parameter(t, requires_grad=template.requires_grad) if isinstance(template, nn.Parameter) else t


@dataclass(frozen=True)
class Slicing:
    """How a tensor initialised whole becomes this rank's piece: the whole's shape, then the slices
    taken in turn, each ``(axis, stride, rank, world)`` (an expert-parallel one before a tensor-parallel one)."""

    full_shape: torch.Size
    steps: tuple[tuple[int, Stride, int, int], ...]


class Materializer:
    """Gives the meta tensors of a model memory, unit by unit (see :meth:`run_unit`)."""

    def __init__(
        self,
        root: nn.Module,
        tree: InitNode,
        init_weights: bool | InitFn,
        shards: dict[int, Slicing],
        device: torch.device,
    ) -> None:
        self.root, self.tree, self.init_weights, self.shards, self.device = root, tree, init_weights, shards, device
        self.initialising = init_weights is not False and device.type != "meta"  # a meta model has no values
        self.done: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its materialised shard
        self.blank_storage: dict[int, int] = {}  # id(work tensor) -> its storage when created
        self.tracker = WriteTracker()
        self.flagged: list[torch.Tensor] = []
        self.hf_owner = self._hf_owners(tree)

    @staticmethod
    def _hf_owners(tree: InitNode) -> dict[int, nn.Module]:
        """For each module the initialiser sees, the nearest enclosing HF PreTrainedModel (whose
        ``_init_weights`` applies), or a graph traced from one that kept the model's ``_init_weights``."""
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - transformers is a hard dependency
            return {}
        owners: dict[int, nn.Module] = {}

        def walk(node: InitNode, owner: nn.Module | None) -> None:
            module = node.init
            owner = module if isinstance(module, PreTrainedModel) or holds_init_weights(module) else owner
            if owner is not None:
                owners[id(module)] = owner
            for child in node.children:
                walk(child, owner)

        walk(tree, None)
        return owners

    @contextmanager
    def protect_finished_tensors(self) -> Iterator[None]:
        """Flag real tensors so that HF's init functions skip them (HF's own ``_is_hf_initialized``)."""
        modules = [*self.root.modules(), *(node.init for node in self.tree.modules())]
        tensors = {id(t): t for m in modules for table in own_tensor_tables(m) for t in table.values() if t is not None}
        self.flagged = [t for t in tensors.values() if not t.is_meta and not is_hf_initialized(t)]
        for t in self.flagged:
            mark_hf_initialized(t)
        try:
            yield
        finally:
            for t in self.flagged:
                unmark_hf_initialized(t)

    def _slots(self, nodes: list[InitNode]) -> list[Slot]:
        """Every slot of the unit's modules: the live modules' (what the model holds) and the
        originals' (what the initialiser writes; the same tensors, or phantoms)."""
        slots = []
        for node in nodes:
            live_ids = set()
            if node.live is not None:
                for table in own_tensor_tables(node.live):
                    for key, t in table.items():
                        if t is not None:
                            slots.append(Slot(node.live, table, key, t, False))
                            live_ids.add(id(t))
            if node.init is not node.live:
                for table in own_tensor_tables(node.init):
                    for key, t in table.items():
                        if t is not None:
                            slots.append(Slot(node.init, table, key, t, id(t) not in live_ids))
        return slots

    def run_unit(self, nodes: list[InitNode], seed: int, keep: set[int] | None = None) -> None:
        """Materialise one unit (unless ``keep`` is given and names none of its tensors)."""
        slots = self._slots(nodes)
        live = [s.tensor for s in slots if not s.phantom]
        if not any(t.is_meta for t in live) or (keep is not None and not any(id(t) in keep for t in live)):
            return  # nothing to materialise; per-unit seeding makes skipping layout-independent
        work: dict[int, torch.Tensor] = {}  # real tensors get one too: the initialiser must not write them
        self.blank_storage = {}  # ids (and addresses) of earlier units' work tensors may be reused
        for slot in slots:
            t = slot.tensor
            if id(t) not in work:
                spec = self.shards.get(id(t))
                work[id(t)] = _blank(spec.full_shape if spec else t.shape, t, self.device)
                self.blank_storage[id(work[id(t)])] = _storage(work[id(t)])
            slot.table[slot.key] = work[id(t)]
        self.tracker.written.clear()
        if self.initialising:
            derived = _derived(nodes, {id(w) for w in work.values()})
            with torch.random.fork_rng(devices=[]), torch.no_grad(), self.tracker:
                torch.manual_seed(seed)
                for node in nodes:
                    self._initialize(node.init, {id(target) for target, _, _ in derived})
                for target, dim, sources in derived:
                    target.copy_(torch.cat(sources, dim))
        for slot in slots:  # phantoms keep their work tensor until the originals are restored
            if not slot.phantom:
                slot.table[slot.key] = self._finish(slot, work[id(slot.tensor)])

    def _initialize(self, module: nn.Module, derived: set[int]) -> None:
        direct = [t for table in own_tensor_tables(module) for t in table.values() if t is not None]
        if direct and all(id(t) in derived for t in direct):
            return  # filled from its origins; drawing random numbers here would shift every later module
        if callable(self.init_weights):
            self.init_weights(module)
            return
        owner = self.hf_owner.get(id(module))
        if owner is not None:
            init_weights(owner, module)
        if hasattr(module, "reset_parameters") and any(self._unwritten(t) for t in direct):
            module.reset_parameters()
        constructed = constructed_values(module)  # values only the constructor sets (models/constructed.py)
        for table in own_tensor_tables(module) if constructed else ():
            for name, value in constructed.items():
                if table.get(name) is not None and self._unwritten(table[name]):
                    table[name].copy_(value)

    def _unwritten(self, t: torch.Tensor) -> bool:
        """True for a work tensor the initialiser never wrote (or left NaNs in)."""
        blank = self.blank_storage.get(id(t))
        if blank is None or t.numel() == 0:
            return False
        storage = _storage(t)
        never = storage == blank and storage not in self.tracker.written
        return never or (t.is_floating_point() and bool(torch.isnan(t).any()))

    def _finish(self, slot: Slot, full: torch.Tensor) -> torch.Tensor:
        original = slot.tensor
        if not original.is_meta:
            return original
        if id(original) in self.done:
            return self.done[id(original)]
        where = f"{type(slot.module).__name__}.{slot.key}"
        spec = self.shards.get(id(original))
        if self.initialising and self._unwritten(full):
            raise SchedulingError(
                f"{where} was not initialised by the model's init function; "
                "pass build(..., init_weights=fn) with an initialiser for it"
            )
        expected = spec.full_shape if spec else original.shape
        if full.shape != expected or full.dtype != original.dtype:
            raise SchedulingError(
                f"the init function replaced {where} with a {full.dtype} tensor of shape {tuple(full.shape)}; "
                f"it must keep {original.dtype} and shape {tuple(expected)} (write into it instead)"
            )
        data = full.detach()
        for axis, stride, rank, world in spec.steps if spec is not None else ():
            data = shard_slice(data, axis, stride, rank, world)
        data = data.to(self.device).contiguous()
        new = nn.Parameter(data, requires_grad=original.requires_grad) if isinstance(original, nn.Parameter) else data
        new.__dict__.update(original.__dict__)  # annotations and Megatron's TP attributes
        if not is_hf_initialized(new):
            mark_hf_initialized(new)  # later (ancestor) units must not re-initialise it
            self.flagged.append(new)
        self.done[id(original)] = new
        return new
