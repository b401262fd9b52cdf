"""Which transformer layers activation recomputation covers.

Megatron-LM's ``--recompute-granularity full`` counts per model chunk, that is per pipeline stage
(virtual stages included), not from the model's first layer:

- ``--recompute-method block``: the first ``--recompute-num-layers`` layers of every chunk are
  recomputed, the rest keep their activations (stages early in the pipeline hold more micro-batches
  in flight, so this is how a user trades memory for compute where it is short).
- ``--recompute-method uniform``: every layer of every chunk. Megatron groups
  ``--recompute-num-layers`` consecutive layers into one recomputed unit; here each layer is its own
  unit (HF models call their layers from a Python loop, which cannot be cut into spans without
  tracing it), so uniform takes ``--recompute-num-layers 1``.

``--recompute-granularity selective`` recomputes only the attention core of every layer
(``softmax(q kᵀ) v`` and its dropout: the activations that grow with the square of the sequence),
as Megatron does.

``--checkpoint-ratio R`` is Slapo's knob: the first ``round(R x n)`` layers of each chunk of ``n``.
The trainer reports the number of layers this returns, which is the number it checkpoints.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from torch import nn

from megatron_slapo.primitives.attention_core import core_kind

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


def recomputed_layers(args: argparse.Namespace, layers: list[str], chunks: int) -> list[str]:
    """The paths of the layers to checkpoint, ``layers`` being cut into ``chunks`` equal stages."""
    ratio = getattr(args, "checkpoint_ratio", None)
    if args.recompute_granularity != "full" and ratio is None:
        return []
    per_chunk = len(layers) // chunks
    if ratio is not None:
        count = math.floor(ratio * per_chunk + 0.5)
    elif args.recompute_method == "uniform":
        count = per_chunk
    else:
        count = min(args.recompute_num_layers, per_chunk)
    return [path for k in range(chunks) for path in layers[k * per_chunk : k * per_chunk + count]]


def attention_cores(model: nn.Module, layers: list[str]) -> list[str]:
    """The paths of the modules whose attention core ``--recompute-granularity selective`` recomputes."""
    return [f"{path}.{name}" for path in layers for name, module in model.get_submodule(path).named_modules()
            if name and core_kind(module)]  # fmt: skip


def describe(args: argparse.Namespace, chosen: int, total: int, chunks: int, depths: int | None = None) -> str:
    """The start-up line saying what was applied; ``depths``: how many layers the model runs, when
    its ``total`` layer modules are shared across them (ALBERT)."""
    shared = f" (shared by {depths} depths: every use recomputed)" if depths and depths != total else ""
    if args.recompute_granularity == "selective":
        return (f"> activation recomputation: the attention core of {chosen} of {total} transformer layers{shared}, "
                "selective")  # fmt: skip
    if getattr(args, "checkpoint_ratio", None) is not None:
        how = f"--checkpoint-ratio {args.checkpoint_ratio:g}"
    else:
        how = f"--recompute-granularity full --recompute-method {args.recompute_method}"
    where = f" (the first {chosen // chunks} of each of {chunks} stages)" if chunks > 1 and chosen < total else ""
    return f"> activation recomputation: {chosen} of {total} transformer layers{where}{shared}, {how}"


def apply(sch: Schedule, args: argparse.Namespace, layers: list[str], chunks: int, depths: int | None = None) -> str:
    """Checkpoint what the flags ask for; return the start-up line saying what was applied
    (``depths``: see :func:`describe`)."""
    if args.recompute_granularity == "selective":
        cores = attention_cores(sch.mod, layers)
        for path in cores:
            sch[path].attention_core(checkpoint=True)
        covered = [layer for layer in layers if any(path.startswith(layer + ".") for path in cores)]
        return describe(args, len(covered), len(layers), chunks, depths)
    chosen = recomputed_layers(args, layers, chunks)
    for path in chosen:
        sch[path].checkpoint()
    return describe(args, len(chosen), len(layers), chunks, depths)
