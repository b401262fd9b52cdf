"""``build``: turn a schedule into the runnable model.

Models too large for one rank are created on the meta device, scheduled, and only then given
memory: each rank materialises just its shards. The initial values must not depend on the layout,
or a TP=2 run would train a different model from the single-device run. So values are defined per
*unit* (a maximal subtree without a ModuleList inside, e.g. one transformer block or the
embedding): the unit is materialised full-size on the CPU, initialised in post-order (children
first, like HF's ``initialize_weights``) from a generator seeded by ``(seed, unit path)``, and each
rank keeps its slices. Any layout, and the unsharded model, get identical full weights for the same
seed, and peak extra memory is one unit. Tensors that are already real (pretrained weights, already
sliced by ``shard``) are never touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.errors import SchedulingError
from megatron_slapo.metadata import ShardSpec
from megatron_slapo.parallel.collectives import comm_device
from megatron_slapo.parallel.layout import shard_slice
from megatron_slapo.parallel.random import get_rng_tracker
from megatron_slapo.primitives.placement import Role, linear_axes
from megatron_slapo.schedule import Schedule

InitFn = Callable[[nn.Module], None]
Slot = tuple[nn.Module, dict, str, torch.Tensor]  # (module, its _parameters or _buffers, key, tensor)


def build(
    sch: Schedule,
    init_weights: bool | InitFn = True,
    *,
    seed: int | None = None,
    device: str | torch.device | None = None,
    stages: Collection[int] | None = None,
    recompute_pipeline_inputs: bool = False,
    after_unit: Callable[[list[nn.Module]], None] | None = None,
) -> nn.Module:
    """Validate ``sch`` and materialise its meta tensors shard-locally; return the module.

    ``init_weights``: ``True`` uses the HF model's ``_init_weights`` (or ``reset_parameters`` for
    plain modules), a callable ``fn(module)`` replaces it, ``False`` leaves new tensors unset (NaN)
    for a checkpoint to fill. ``seed`` defaults to ``torch.initial_seed()`` of global rank 0.
    ``device`` defaults to the current CUDA device, else the CPU. When the schedule has
    ``cut_pipeline_stage`` marks, the result is a :class:`~megatron_slapo.pipeline.PipelineStages`
    (the stage modules, the tensors crossing each cut, the weights tied across stages). Then
    ``stages`` limits materialisation to what those stages use (a pipeline rank's own stages; the
    others keep meta tensors), and ``recompute_pipeline_inputs`` is passed on to
    :func:`~megatron_slapo.pipeline.partition`. ``after_unit(modules)`` is called as soon as a
    unit's tensors are final, e.g. to partition them with ZeRO-3 before the next unit is allocated.
    """
    validate(sch)
    seed = agreed_seed(seed)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    shards = {
        id(node._tensor(name)): (spec, node.rank, node.world_size)
        for _, node in sch.named_schedules()
        for name, spec in node.metadata.shards.items()
    }
    cut = any(node.metadata.pipeline_cut for _, node in sch.named_schedules())
    keep = None
    if cut and stages is not None:
        from megatron_slapo.pipeline import partition

        planned = partition(sch, recompute_pipeline_inputs).stages  # on meta: which tensors each stage uses
        keep = {id(t) for k in stages for t in (*planned[k].parameters(), *planned[k].buffers())}
    materializer = _Materializer(sch.mod, init_weights, shards, torch.device(device))
    with materializer.protect_finished_tensors():
        for unit_path, modules in _units(sch.mod, ""):
            materializer.run_unit(unit_path, modules, _derive_seed(seed, unit_path), keep)
            if after_unit is not None:
                after_unit([module for _, module in modules])
    if cut:
        from megatron_slapo.pipeline import partition

        return partition(sch, recompute_pipeline_inputs)
    return sch.mod


def validate(sch: Schedule) -> None:
    """Check that the schedule is consistent before anything is computed."""
    for _, node in sch.named_schedules():
        role, shards = node.metadata.role, node.metadata.shards
        has_bias = isinstance(getattr(node.mod, "bias", None), torch.Tensor)
        if role is Role.COLUMN and has_bias:
            bias = shards.get("bias")
            if bias is None:
                raise node._error("column-parallel layer: shard its bias too, shard('bias', axis=0)")
            if bias.stride != shards["weight"].stride:
                raise node._error(f"bias stride {bias.stride} differs from weight stride {shards['weight'].stride}")
        if role is Role.ROW and "bias" in shards:
            raise node._error("row-parallel layer: its bias is added after the reduction and must not be sharded")
        weight = shards.get("weight")
        if role is not None and weight is not None and not weight.explicit and not node.metadata.syncs:
            raise node._error(
                f"'weight' is tied to a tensor sharded elsewhere, which made this layer {role.value}-parallel "
                "too; schedule it as well (its shard and sync)"
            )
        if "bias" in shards and "weight" not in shards and linear_axes(node.mod) is not None:
            raise node._error("the bias is sharded but the weight is not")
        if node.metadata.forked_rng and not get_rng_tracker().is_seeded():
            raise node._error(
                "fork_rng() needs the model-parallel RNG stream: call megatron_slapo.parallel.initialize() "
                "or megatron_slapo.parallel.seed() first",
                SchedulingError,
            )


def agreed_seed(seed: int | None) -> int:
    """``seed``, or rank 0's ``torch.initial_seed()`` so that every rank agrees."""
    if seed is not None:
        return seed
    value = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(value, src=0)  # an unseeded process must not init different full weights per rank
    return int(value.item())


def _derive_seed(seed: int, unit_path: str) -> int:
    digest = hashlib.sha256(f"{seed}/{unit_path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _has_container(module: nn.Module) -> bool:
    return any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in module.modules())


def _post_order(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{path}.{name}" if path else name)
    yield path, module


def _units(module: nn.Module, path: str) -> Iterator[tuple[str, list[tuple[str, nn.Module]]]]:
    """Initialisation units in post-order: container-free subtrees, then each container's own tensors."""
    if not _has_container(module):
        yield path, list(_post_order(module, path))
        return
    for name, child in module.named_children():
        yield from _units(child, f"{path}.{name}" if path else name)
    yield path, [(path, module)]


def _blank(shape: torch.Size, template: torch.Tensor) -> torch.Tensor:
    """A fresh CPU tensor for ``template``'s values; floats start as NaN so partial writes show."""
    t = torch.empty(shape, dtype=template.dtype)
    if t.is_floating_point():
        t.fill_(float("nan"))
    return nn.Parameter(t, requires_grad=template.requires_grad) if isinstance(template, nn.Parameter) else t


def _unwritten(t: torch.Tensor, version: int) -> bool:
    """True if the initialiser never wrote ``t`` (its version counter did not move) or left NaNs."""
    return t._version == version or (t.is_floating_point() and bool(torch.isnan(t).any()))


class _Materializer:
    def __init__(
        self,
        root: nn.Module,
        init_weights: bool | InitFn,
        shards: dict[int, tuple[ShardSpec, int, int]],
        device: torch.device,
    ) -> None:
        self.root, self.init_weights, self.shards, self.device = root, init_weights, shards, device
        self.done: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its materialised shard
        self.versions: dict[int, int] = {}  # id(work tensor) -> version counter before initialisation
        self.hf_owner = self._hf_owners(root)

    @staticmethod
    def _hf_owners(root: nn.Module) -> dict[int, nn.Module]:
        """For each module, the nearest enclosing HF PreTrainedModel (whose ``_init_weights`` applies),
        or a graph traced from one (the tracer keeps the model's ``_init_weights``)."""
        try:
            from transformers import PreTrainedModel
        except ImportError:  # pragma: no cover - transformers is a hard dependency
            return {}
        owners: dict[int, nn.Module] = {}

        def walk(module: nn.Module, owner: nn.Module | None) -> None:
            owner = module if isinstance(module, PreTrainedModel) or "_init_weights" in vars(module) else owner
            if owner is not None:
                owners[id(module)] = owner
            for child in module.children():
                walk(child, owner)

        walk(root, None)
        return owners

    @contextmanager
    def protect_finished_tensors(self) -> Iterator[None]:
        """Flag real tensors so that HF's init functions skip them (HF's own ``_is_hf_initialized``)."""
        flagged = [t for t in self._all_tensors() if not t.is_meta and not getattr(t, "_is_hf_initialized", False)]
        for t in flagged:
            t._is_hf_initialized = True
        self.flagged = flagged
        try:
            yield
        finally:
            for t in self.flagged:
                del t._is_hf_initialized

    def _all_tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for m in self.root.modules():
            for table in (m._parameters, m._buffers):
                for t in table.values():
                    if t is not None:
                        seen.setdefault(id(t), t)
        return list(seen.values())

    def run_unit(self, unit_path: str, modules: list[tuple[str, nn.Module]], seed: int,
                 keep: set[int] | None = None) -> None:  # fmt: skip
        """Materialise one unit (unless ``keep`` is given and names none of its tensors)."""
        slots: list[Slot] = [
            (m, table, key, t)
            for _, m in modules
            for table in (m._parameters, m._buffers)
            for key, t in table.items()
            if t is not None
        ]
        if not any(t.is_meta for *_, t in slots) or (keep is not None and not any(id(t) in keep for *_, t in slots)):
            return  # nothing to materialise; per-unit seeding makes skipping layout-independent
        work: dict[int, torch.Tensor] = {}
        self.versions = {}
        for _, table, key, t in slots:
            if id(t) not in work:
                spec = self.shards.get(id(t))
                work[id(t)] = _blank(spec[0].full_shape if spec else t.shape, t)
                self.versions[id(work[id(t)])] = work[id(t)]._version
            table[key] = work[id(t)]
        if self.init_weights is not False:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed)
                for path, module in modules:
                    self._initialize(path, module)
        for module, table, key, t in slots:
            table[key] = self._finish(module, key, t, work[id(t)])

    def _initialize(self, path: str, module: nn.Module) -> None:
        if callable(self.init_weights):
            self.init_weights(module)
            return
        owner = self.hf_owner.get(id(module))
        if owner is not None:
            owner._init_weights(module)
        direct = [t for table in (module._parameters, module._buffers) for t in table.values() if t is not None]
        if hasattr(module, "reset_parameters") and any(self._unwritten(t) for t in direct):
            module.reset_parameters()

    def _unwritten(self, t: torch.Tensor) -> bool:
        version = self.versions.get(id(t))
        return version is not None and _unwritten(t, version)

    def _finish(self, module: nn.Module, key: str, original: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if not original.is_meta:
            return original
        if id(original) in self.done:
            return self.done[id(original)]
        if self.init_weights is not False and self._unwritten(full):
            raise SchedulingError(
                f"{type(module).__name__}.{key} was not initialised by the model's init function; "
                "pass build(..., init_weights=fn) with an initialiser for it"
            )
        data = full.detach()
        spec = self.shards.get(id(original))
        if spec is not None:
            shard, rank, world = spec
            data = shard_slice(data, shard.axis, shard.stride, rank, world)
        data = data.to(self.device).contiguous()
        new = nn.Parameter(data, requires_grad=original.requires_grad) if isinstance(original, nn.Parameter) else data
        new.__dict__.update(original.__dict__)  # annotations and Megatron's TP attributes
        if not getattr(new, "_is_hf_initialized", False):
            new._is_hf_initialized = True  # later (ancestor) units must not re-initialise it
            self.flagged.append(new)
        self.done[id(original)] = new
        return new
