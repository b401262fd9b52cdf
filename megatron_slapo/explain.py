"""``Schedule.explain()``: what a schedule did to its model, module by module, as text.

One line per module that a primitive touched: its tensor-parallel role, each sharded tensor (axis,
stride, whole shape -> this rank's), the collectives it inserts, recompute, the model-parallel RNG
stream, compilation, FP8 products, tracing, a pipeline cut, a module replaced (a kernel swapped in). Layers that received the same
primitives are one line, their index written ``*`` and their number after it. The first line sums this rank's
parameters against the unsharded model's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_slapo.compat.torch_nn import own_parameters
from megatron_slapo.parallel.layout import block_count

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


def _op_name(op: str | Callable[..., Any]) -> str:
    return op if isinstance(op, str) else getattr(op, "__name__", type(op).__name__)


def applied(node: ScheduleNode) -> list[str]:
    """What the primitives recorded on ``node``, in words (empty when nothing was applied)."""
    meta, items = node.metadata, []
    if meta.replaced:
        items.append(f"replaced {meta.replaced} by {type(node.mod).__name__}")
    if meta.role is not None:
        items.append(f"{meta.role.value}-parallel")
    for name, split in sorted(meta.expert_shards.items()):
        n = split.full_shape[0] // split.size
        items.append(f"experts {name}: {split.rank * n}..{(split.rank + 1) * n - 1} of {split.full_shape[0]} "
                     f"(expert-parallel rank {split.rank} of {split.size})")  # fmt: skip
    for name, spec in sorted(meta.shards.items()):
        local = tuple(getattr(node.mod, name).shape)
        stride = f", stride {spec.stride}" if block_count(spec.stride) > 1 else ""
        tied = "" if spec.explicit else " (tied)"
        items.append(f"shard {name} axis {spec.axis}{stride}: {tuple(spec.full_shape)} -> {local}{tied}")
    items += sorted(f"sync {mode} {_op_name(op)}" for mode, op in meta.syncs)
    flags = (("checkpoint", meta.checkpointed), ("checkpoint attention core", meta.core_checkpointed),
             ("fork_rng", meta.forked_rng), ("trace", meta.traced), ("cut_pipeline_stage", meta.pipeline_cut))  # fmt: skip
    items += [word for word, on in flags if on]
    if meta.compiled:
        items.append(f"compile({meta.compiled})")
    if meta.fp8:
        items.append(meta.fp8)
    if meta.sequence_split:
        items.append(f"sequence parallel: {meta.sequence_split}")
    if meta.context_parallel > 1:
        items.append(f"attention core: the ring over {meta.context_parallel} context-parallel ranks")
    return items


def explain(sch: ScheduleNode) -> str:
    """The report described in the module docstring."""
    groups: dict[tuple[str, str], list[str]] = {}  # (path with layer indices as *, what) -> paths
    for path, node in sch.named_schedules():
        items = applied(node)
        if items:
            key = (re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path), "; ".join(items))
            groups.setdefault(key, []).append(path or "<root>")
    lines = [(paths[0] if len(paths) == 1 else f"{pattern} (x{len(paths)})", what)
             for (pattern, what), paths in groups.items()]  # fmt: skip
    local = sum(p.numel() for p in sch.mod.parameters())
    sharded = {}  # tensor id -> (whole, local) elements: a tied tensor once, as parameters() counts it
    for _, node in sch.named_schedules():
        for name in {**node.metadata.shards, **node.metadata.expert_shards}:
            if name not in own_parameters(node.mod):  # a buffer (BatchNorm's statistics): not a parameter
                continue
            split = node.metadata.expert_shards.get(name)  # the experts' whole, before any feature shard
            tensor = getattr(node.mod, name)
            sharded[id(tensor)] = ((split or node.metadata.shards[name]).full_shape.numel(), tensor.numel())
    whole = local + sum(full - here for full, here in sharded.values())
    head = (f"{type(sch.mod).__name__}: tensor-parallel rank {sch.rank} of {sch.world_size}; parameters here "
            f"{local:,} of {whole:,} ({local / max(whole, 1):.0%})")  # fmt: skip
    if not lines:
        return f"{head}\n(no primitive applied)"
    width = max(len(path) for path, _ in lines)
    return "\n".join([head, *(f"{path:<{width}}  {what}" for path, what in lines)])
