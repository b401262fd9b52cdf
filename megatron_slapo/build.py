"""``build``: turn a schedule into the runnable model.

Models too large for one rank are created on the meta device, scheduled, and only then given
memory: each rank materialises just its shards. The initial values must not depend on the layout,
or a TP=2 run would train a different model from the single-device run. So values are defined per
*unit* (a maximal subtree without a ModuleList inside, e.g. one transformer block or the
embedding): the unit is materialised full-size on the CPU, initialised in post-order (children
first, like HF's ``initialize_weights``) from a generator seeded by ``(seed, unit path)``, and each
rank keeps its slices. Any layout, and the unsharded model, get identical full weights for the same
seed, and peak extra memory is one unit. Tensors that are already real (pretrained weights, already
sliced by ``shard``) are never touched. Units, their order and the modules the initialiser is called
on are those of the model before tracing (:mod:`megatron_slapo.init_tree`), so tracing (with or
without ``flatten``) changes no initial value; :mod:`megatron_slapo.materialize` does the work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo.errors import SchedulingError
from megatron_slapo.graph_edit import why_never_called
from megatron_slapo.init_tree import init_tree, originals_see_live, units
from megatron_slapo.materialize import InitFn, Materializer, Slicing
from megatron_slapo.metadata import Role
from megatron_slapo.parallel.collectives import comm_device
from megatron_slapo.parallel.layout import relative_sizes
from megatron_slapo.parallel.random import get_rng_tracker
from megatron_slapo.primitives.compile import apply_compiles
from megatron_slapo.primitives.placement import linear_axes
from megatron_slapo.schedule import Schedule


def _slicings(node: Schedule) -> dict[str, Slicing]:
    """How each tensor ``node`` sliced is cut from its whole: experts first, then features."""
    found = {}
    for name in {**node.metadata.expert_shards, **node.metadata.shards}:
        expert, spec = node.metadata.expert_shards.get(name), node.metadata.shards.get(name)
        steps = ((0, 1, expert.rank, expert.size),) if expert else ()
        steps += ((spec.axis, spec.stride, node.rank, node.world_size),) if spec else ()
        found[name] = Slicing(expert.full_shape if expert else spec.full_shape, steps)
    return found


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
    ``device`` defaults to the current CUDA device, else the CPU; on ``"meta"`` (a plan, as
    ``tools/explain.py`` builds) nothing is allocated or initialised: each tensor becomes a meta one
    of its shard's shape, with the annotations a materialised one gets. When the schedule has
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
    shards = {id(node._tensor(name)): slicing for _, node in sch.named_schedules()
              for name, slicing in _slicings(node).items()}  # fmt: skip
    cut = any(node.metadata.pipeline_cut for _, node in sch.named_schedules())
    keep = None
    if cut and stages is not None:
        from megatron_slapo.pipeline import partition

        planned = partition(sch, recompute_pipeline_inputs).stages  # on meta: which tensors each stage uses
        keep = {id(t) for k in stages for t in (*planned[k].parameters(), *planned[k].buffers())}
    tree = init_tree(sch.mod)
    materializer = Materializer(sch.mod, tree, init_weights, shards, torch.device(device))
    with originals_see_live(tree), materializer.protect_finished_tensors():
        for unit_path, nodes in units(tree):
            materializer.run_unit(nodes, _derive_seed(seed, unit_path), keep)
            if after_unit is not None:
                after_unit([node.live for node in nodes if node.live is not None])
    apply_compiles(sch)
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
            if relative_sizes(bias.stride) != relative_sizes(shards["weight"].stride):
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
        if role is Role.VOCAB or (role is Role.ROW and has_bias):
            never = why_never_called(node)
            if never:  # the placement's own forward (lookup of own rows / bias after the reduction) never runs
                what = "vocabulary-parallel lookup" if role is Role.VOCAB else "bias add after the reduction"
                raise node._error(f"{role.value}-parallel layer whose {what} cannot happen: {never}. Shard it "
                                  "as a layer the graph calls (decompose only layers that are not row-parallel)")  # fmt: skip
        check = getattr(node.mod, "schedule_problem", None)  # modules that know how they may be sharded
        problem = check() if callable(check) else None
        if problem:
            raise node._error(problem)
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
