"""Which layers ``--fp8-format`` runs in FP8: the transformer layers' projections, as Megatron and
torchtitan choose them.

Every nn.Linear / HF Conv1D inside the transformer layers (attention's q, k, v and output
projections, the MLP's, a shared expert's) gets the ``fp8`` primitive after the schedule has
placed it. Outside the layers nothing changes: the embedding, the LM head and the final norm stay
in their precision (the logits and the loss are where FP8's three bits of mantissa would cost the
most), and inside them the norms and an MoE router do too (a router's scores pick experts: an
error there moves tokens). A matrix the layers hold that cannot run in FP8 is named in the note
the trainer prints, with the reason: a Linear whose dimensions are not multiples of 16, grouped
3-D expert weights (torchao's FP8 grouped GEMM is a CUDA-only prototype, with no emulation to
test it by), a layer whose forward is its own, and a layer left whole under tensor parallelism
whose gradients are each rank's part (tagged ``sequence_parallel``, as DeepSeek's latent-attention
down-projections are: their output gradient reaches each rank as a partial sum, which one scale
per rank would round unlike one process). A layer the schedule already runs in FP8 keeps
the schedule's recipe.
"""

from __future__ import annotations

import re

from torch import nn

from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels.fp8 import Fp8Recipe
from megatron_slapo.parallel.collectives import Group
from megatron_slapo.primitives.fp8 import fp8_problem
from megatron_slapo.schedule import Schedule

ROUTERS = ("gate", "router")  # an MoE block's router, by its name in HF's MoE blocks


def _matrices(module: nn.Module) -> bool:
    """Whether ``module`` itself holds a weight of two or more dimensions (a product the layer computes)."""
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _why_kept(path: str, node: Schedule) -> str | None:
    """Why the layers' matrix at ``path`` stays in its precision, or ``None`` to run it in FP8."""
    module = node.mod
    if path.rsplit(".", 1)[-1] in ROUTERS:
        return "an MoE router"
    partial = node.metadata.annotations.get("weight", {}).get("sequence_parallel")
    if node.world_size > 1 and node.metadata.role is None and partial:
        return ("whole on every tensor-parallel rank, each with its part of the gradients (MLA's down-projections): "
                "each rank would scale its part alone")  # fmt: skip
    if not isinstance(module, nn.Linear) and any(p.dim() == 3 for p in module.parameters(recurse=False)):
        return "grouped expert weights: torchao's FP8 grouped GEMM is a CUDA-only prototype"
    return fp8_problem(module)


def apply(sch: Schedule, recipe: Fp8Recipe, layers: list[str], tokens: Group = None) -> str:
    """Run the eligible products of the transformer ``layers`` in FP8 (scales agreed over ``tokens``,
    the context-parallel group, as well as over each layer's tensor-parallel split); return the note
    the trainer prints: how many layers, and each kept matrix with why (layers alike written once)."""
    converted, kept = 0, {}
    for layer in layers:
        for relative, node in sch[layer].named_schedules():
            if not _matrices(node.mod):
                continue
            if node.metadata.fp8:  # the schedule named it (with a recipe of its own)
                converted += 1
                continue
            path = f"{layer}.{relative}" if relative else layer
            why = _why_kept(path, node)
            if why:
                kept.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path), why)
                continue
            node.fp8(recipe, tokens=tokens)
            converted += 1
    if not converted:
        raise SchedulingError(
            "--fp8-format: no Linear layer of the transformer layers can run in FP8 ("
            + "; ".join(f"{path}: {why}" for path, why in kept.items())
            + ")"
        )
    how = f"{recipe.recipe} scaling, {recipe.format} format"
    if recipe.emulate:
        how += "; emulated: no FP8 matrix units here, so the FP8 values are multiplied in fp32"
    note = f"> FP8 ({how}): {converted} Linear layers of {len(layers)} transformer layers"
    if kept:
        note += "; kept in their precision: " + "; ".join(f"{path} ({why})" for path, why in kept.items())
    return note
