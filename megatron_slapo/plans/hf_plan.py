"""Megatron-style placements read from an HF model's own tensor-parallel plan (``--schedule auto``).

transformers 5 configs publish ``base_model_tp_plan``: module-path patterns of the base model
(``layers.*.self_attn.q_proj``) with a style (``colwise``, ``rowwise``, ...). HF runs such a plan
with DTensor, one collective per projection. :func:`plan_from_hf` turns it into this project's
placements, with Megatron's collectives:

- ``colwise`` layers are :class:`ColumnParallel` without an input reduction of their own; their
  parent (the attention module, the MLP) is one :class:`ParallelRegionInput`, so q, k and v (or
  gate and up) share one input-gradient all-reduce and, where they can, one GEMM, as in Megatron;
- grouped-query attention's key/value projections are split the same way; when the TP size is a
  multiple of their heads rather than a divisor, each rank all-gathers them and keeps the head of
  its query heads (:class:`KeyValueColumnParallel`, Megatron's way);
- ``rowwise`` layers are :class:`RowParallel` (all-reduce of the output, then the bias);
- ``moe_tp_experts`` modules (with their ``packed_colwise`` gate|up and ``rowwise`` down weights) are
  :class:`~megatron_slapo.plans.experts.TensorParallelExperts`: every expert split by its
  features, one reduction per MoE block, the router replicated;
- ``colwise_gather_output`` / ``rowwise_split_input`` (HF gathers q/k/v or gate|up whole and splits
  them again) are placed as Megatron places the block where it has a row-parallel layer to end the
  region: packed projections strided, full-width q/k norms split with their sums of squares
  all-reduced (:mod:`~megatron_slapo.plans.gathered_outputs`); otherwise followed to the letter;
- ``replicated_with_grad_allreduce`` parameters (Qwen3's per-head q/k norms) see only this rank's
  heads: their gradients are partial sums, tagged as Megatron tags such parameters
  (``sequence_parallel``), so every engine sums them over the tensor-parallel ranks; so are
  single-number parameters inside a region (Apertus' activation slopes);
- a plan that names nothing of the layers' attention, which has Llama's four projections
  (GraniteMoE's), is completed with Llama's entries for it;
- the input embedding is vocabulary-parallel (a scaled one, Gemma's, keeps its scale) and the LM head vocabulary-parallel with the
  vocabulary-parallel loss (the plan itself leaves both whole); the final norm gathers the
  sequence under ``--sequence-parallel``;
- attention modules get their head counts divided where they keep them as attributes (found
  generically: integer attributes named like head or width counts whose value is the config's),
  and their attention-probability dropout on the model-parallel RNG stream;
- multi-head latent attention (DeepSeek's MLA), which the plans leave out (DeepSeek-V3's) or give
  a style nothing implements (DeepSeek-V2's ``mla_kv_a_proj``), is placed wherever a model has it,
  split by heads (:mod:`~megatron_slapo.plans.latent_attention`); the plan's entries inside it are
  set aside.

A style this translation cannot honour is one error naming the module pattern and the style. In an
MoE model a pattern naming a module this configuration lacks (the dense MLP, when every layer is
sparse) is left out; a region is the modules that hold the column-parallel layers, so an MoE model
whose first layers are dense gets regions in those layers only. A module the plan does not name
stays whole on every rank: qwen2_moe's plan leaves its shared expert so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from megatron_slapo.errors import SchedulingError
from megatron_slapo.parallel.layout import Stride
from megatron_slapo.plans.expert_parallel import ExpertParallelExperts
from megatron_slapo.plans.experts import TensorParallelExperts
from megatron_slapo.plans.fusion import why_not_fused
from megatron_slapo.plans.gathered_outputs import GATHERED, gathered_column, megatron_form
from megatron_slapo.plans.latent_attention import LatentAttentionHeads, is_latent_attention
from megatron_slapo.plans.sequence import SplitAlongSequence
from megatron_slapo.plans.styles import (
    ColumnParallel,
    HeadParallelDropout,
    LocalHeads,
    ParallelRegionInput,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    compile_pattern,
    matching,
    placements_of,
)
from megatron_slapo.primitives.attention_core import core_kind

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

# The styles plan_from_hf honours (packed_colwise: an experts module's gate|up weight)
STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "moe_tp_experts", "packed_colwise", *GATHERED)
# Under --sequence-parallel, the dim a region gathers and its row-parallel layers scatter: the one
# before the features, the sequence of (batch, sequence, features) and the tokens of (tokens, features)
# (an MoE block's shared experts see the tokens flattened; each rank's come whole, in order)
ROWS = -2
# Families whose plan cannot run split along the sequence (--sequence-parallel), and why
NO_SEQUENCE_PARALLEL = {
    "nanochat": "it runs its final norm on the embeddings too: no module ends the split alone",
    "minimax": "its plan leaves the lightning-attention layers whole, and they mix the tokens of the whole sequence",
    "qwen3_next": "its plan runs the linear-attention layers whole, and they carry a state along the whole sequence",
}
# Attributes an attention module may size its reshapes from, and the config fields they mirror
HEAD_ATTRS = {
    "num_heads": "num_attention_heads", "num_attention_heads": "num_attention_heads", "n_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads", "num_kv_heads": "num_key_value_heads",
    "hidden_size": "hidden_size", "embed_dim": "hidden_size", "all_head_size": "hidden_size",
}  # fmt: skip


@dataclass(frozen=True)
class PartialGradients:
    """A replicated module applied to this rank's heads only: its parameters' gradients are partial
    sums over the tensor-parallel ranks (tagged ``sequence_parallel``: the engines sum them)."""

    def apply(self, sch: Schedule) -> None:
        for name, _ in sch.mod.named_parameters(recurse=False):
            sch.annotate(name, "sequence_parallel", True)


class HeadSlice:
    """``x[..., start:end]``: this rank's key/value head, out of the gathered ones."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.start : self.end]


@dataclass(frozen=True)
class KeyValueColumnParallel(ColumnParallel):
    """A key or value projection of grouped-query attention. When the TP size divides its heads it
    is a plain column-parallel layer. When the TP size is a multiple of them (8 ranks, 2 heads), the
    heads are shared by several ranks, and Megatron's answer is kept: the weight stays split evenly
    (no copy of it to keep in step), the output is all-gathered along the features and each rank
    takes the head of its query heads; backward, the gradient is reduce-scattered, which sums what
    the ranks sharing a head give it."""

    reduce_input_grad: bool = False  # the attention block's ParallelRegionInput reduces it
    kv_heads: int = 1  # the model's key/value heads (plan_from_hf gives both from the config)
    head_dim: int = 1

    def apply(self, sch: Schedule) -> None:
        super().apply(sch)
        tp = sch.world_size
        if self.kv_heads % tp == 0:
            return
        if tp % self.kv_heads:
            raise sch._error(f"the tensor-parallel size {tp} neither divides nor is a multiple of the "
                             f"{self.kv_heads} key/value heads")  # fmt: skip
        head = sch.rank // (tp // self.kv_heads)
        sch.sync("fwd_post", "all_gather", axis=-1, backward="reduce_scatter")
        sch.sync("fwd_post", HeadSlice(head * self.head_dim, (head + 1) * self.head_dim))


@dataclass(frozen=True)
class LocalHeadAttrs:
    """Divide, by the TP size, the integer attributes of an attention module that count heads or
    features of the whole model (:data:`HEAD_ATTRS` whose value is the config's)."""

    config: Any

    def apply(self, sch: Schedule) -> None:
        tp = sch.world_size
        kv, heads = getattr(self.config, "num_key_value_heads", None), self.config.num_attention_heads
        shared_kv = bool(kv) and kv < tp and tp % kv == 0  # one key/value head a rank (KeyValueColumnParallel)
        divided = []
        for attr, field in HEAD_ATTRS.items():
            value = getattr(sch.mod, attr, None)
            if not isinstance(value, int) or value != getattr(self.config, field, None):
                continue  # not a count of the whole model's
            if shared_kv and field == "num_key_value_heads":
                setattr(sch.mod, attr, 1)
            else:
                divided.append(attr)
        if divided:
            LocalHeads(*divided).apply(sch)  # each divided by the TP size, which must divide it
        if shared_kv and isinstance(getattr(sch.mod, "num_key_value_groups", None), int):
            sch.mod.num_key_value_groups = heads // tp  # this rank's query heads, all on its one key/value head


def _adds_positions(base: nn.Module, embedding: nn.Module) -> bool:
    """Whether another embedding (positions, token types) is added to the token lookup."""
    return any(isinstance(m, nn.Embedding) and m is not embedding for m in base.modules())


def _path(model: nn.Module, name: str | None, wanted: str, fallback: nn.Module | None) -> str:
    """The path of module ``name`` in ``model``, else of ``fallback`` (an HF accessor's answer)."""
    modules = dict(model.named_modules())
    if name and name in modules:
        return name
    found = next((path for path, m in modules.items() if m is fallback), None) if fallback is not None else None
    if found is None:
        raise SchedulingError(f"--schedule auto: cannot find the {wanted} of this model")
    return found


def plan_from_hf(model: nn.Module, config: Any, sequence_parallel: bool = False,
                 expert_parallel: ExpertParallelExperts | None = None) -> dict[str, Any]:  # fmt: skip
    """This project's plan (see :func:`~megatron_slapo.plans.styles.apply_plan`) for ``model``
    (an HF model, or its root traced for pipeline stages), from ``config.base_model_tp_plan``;
    SchedulingError for a style it cannot honour, or for a family that cannot run split along the
    sequence when ``sequence_parallel``. ``expert_parallel``: the placement of the experts modules
    that ``config.base_model_ep_plan`` dispatches (``ep_dispatch_experts``), in place of the TP plan's."""
    kind = config.model_type
    if sequence_parallel and kind in NO_SEQUENCE_PARALLEL:
        raise SchedulingError(f"--schedule auto cannot split {kind} along the sequence: {NO_SEQUENCE_PARALLEL[kind]}")
    tp_plan = getattr(config, "base_model_tp_plan", None)
    if not tp_plan:
        raise SchedulingError(f"--schedule auto: the {kind} config publishes no base_model_tp_plan to follow")
    layers = next((p.split(".")[0] for p in tp_plan if ".*." in p), "layers")  # "layers" in "layers.*.self_attn.q_proj"
    base = next(
        (p for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and p.split(".")[-1] == layers), None
    )
    if base is None:
        raise SchedulingError(f"--schedule auto: no {layers!r} module list in this {kind} model")
    prefix = base[: -len(layers)]
    tp_plan = _with_attention(model.get_submodule(base), layers, tp_plan)
    pp_plan = getattr(config, "base_model_pp_plan", None) or {}
    hf = model if isinstance(model, PreTrainedModel) else None
    embedding_path = _path(model, prefix + next(iter(pp_plan)) if pp_plan else None, "input embedding",
                           hf.get_input_embeddings() if hf else None)  # fmt: skip
    embedding = model.get_submodule(embedding_path)
    base_model = model.get_submodule(prefix.rstrip(".")) if prefix else model
    plan: dict[str, Any] = {embedding_path: VocabParallelEmbedding(positions=_adds_positions(base_model, embedding))}
    present = [p for p, _ in model.named_modules() if p]
    experts = [prefix + p for p, style in tp_plan.items() if style == "moe_tp_experts"]
    if expert_parallel is not None:
        dispatched = _expert_parallel_paths(config, prefix)
        plan.update(dict.fromkeys(dispatched, expert_parallel))
        experts += dispatched
    latent = [p for p, m in model.named_modules() if p and is_latent_attention(m)]
    regions: dict[str, list[str]] = {}  # region -> its column-parallel children
    styles, strides, gathered = megatron_form(model, present, {prefix + p: s for p, s in tp_plan.items()}, config)
    for path, style in styles.items():
        pattern = path[len(prefix) :]
        if any(path.startswith(e + ".") for e in experts):  # gate_up_proj, down_proj: the experts' weights
            continue
        if latent and _within(present, path, latent):  # multi-head latent attention: placed below, not by HF's plan
            continue
        if experts and not any(compile_pattern(path).match(p) for p in present):  # an MoE model's layers may all
            continue  # be sparse: its dense MLP's patterns match nothing (elsewhere, apply_plan's error stands)
        if style in ("colwise", "colwise_gather_output") and not any(compile_pattern(path).match(p) for p in present):
            raise SchedulingError(f"--schedule auto: {kind} plans {pattern!r} as {style!r}, and no module of this model "
                                  "has that path (a parameter's placement, which it cannot honour yet, or a module "
                                  "these layers lack)")  # fmt: skip
        if style == "colwise":
            plan[path] = _column(model, present, path, config, strides.get(path, 1))
            for region in _parents(present, path):
                regions.setdefault(region, []).append(path.rpartition(".")[2])
        elif style == "rowwise":
            plan[path] = RowParallel(sequence_dim=ROWS)
        elif style == "replicated_with_grad_allreduce":
            plan[path] = PartialGradients()
        elif style == "moe_tp_experts":
            plan.setdefault(path, TensorParallelExperts())  # unless expert-parallel
        elif style == "colwise_gather_output":  # where megatron_form left it: to the letter
            plan[path] = gathered_column()
        elif not (style == "embedding_rowwise" and path == embedding_path):  # that one is ours already
            raise SchedulingError(f"--schedule auto: {kind} plans {pattern!r} as {style!r}, which it cannot honour "
                                  f"yet (it follows {', '.join(STYLES)})")  # fmt: skip
    sample = dict(model.named_modules())
    for parent, children in regions.items():  # the first layer's module stands for the pattern's
        module = sample[next(p for p in present if compile_pattern(parent).match(p))]
        attention = core_kind(module) is not None
        region = ParallelRegionInput(sequence_dim=ROWS, fuse=_fusable(module, children))
        plan = {parent: (region, LocalHeadAttrs(config), HeadParallelDropout()) if attention else (region,), **plan}
        for sub in _scalar_holders(module):  # Apertus' xIELU activation: its slopes scale this rank's features
            plan.setdefault(f"{parent}.{sub}", PartialGradients())
    for path, placement in gathered.items():  # after the regions: LocalConfig joins its attention module's entry
        plan[path] = (*placements_of(plan[path]), placement) if path in plan else placement
    for attention in latent:  # one entry a layer: a hybrid model may give other layers other attention there
        heads = LatentAttentionHeads(sequence_dim=ROWS)
        plan = {attention: (ParallelRegionInput(sequence_dim=ROWS), heads, HeadParallelDropout()), **plan}
    norm = _final_norm(base_model, prefix, pp_plan)
    if norm:
        plan[norm] = SplitAlongSequence(gather_output=True)
    plan[_path(model, "lm_head", "LM head", hf.get_output_embeddings() if hf else None)] = VocabParallelHead()
    return plan


def _with_attention(layers: nn.ModuleList, name: str, tp_plan: dict[str, str]) -> dict[str, str]:
    """``tp_plan``, completed with Llama's attention entries where it names nothing of the layers'
    attention and that attention has Llama's four projections (GraniteMoE's plan names only its
    experts): Megatron splits every attention block, and sequence parallelism needs it split."""
    first = layers[0] if len(layers) else None
    for child, module in first.named_children() if first is not None else ():
        projections = [getattr(module, f"{p}_proj", None) for p in "qkvo"]
        if core_kind(module) is None or not all(type(p) is nn.Linear for p in projections):
            continue
        if any(pattern.startswith(f"{name}.*.{child}.") for pattern in tp_plan):
            continue
        entries = {f"{name}.*.{child}.{p}_proj": "colwise" for p in "qkv"}
        tp_plan = {**entries, f"{name}.*.{child}.o_proj": "rowwise", **tp_plan}
    return tp_plan


def _expert_parallel_paths(config: Any, prefix: str) -> list[str]:
    """The experts modules ``config.base_model_ep_plan`` dispatches to expert-parallel ranks (its
    ``grouped_gemm`` entries name their weights, which ExpertParallelExperts multiplies so where it can)."""
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    paths = [prefix + p for p, style in ep_plan.items() if style == "ep_dispatch_experts"]
    if not paths:
        raise SchedulingError(f"--expert-model-parallel-size: the {config.model_type} config publishes no "
                              "base_model_ep_plan naming its experts (ep_dispatch_experts): a dense model has none to place")  # fmt: skip
    return paths


def _column(model: nn.Module, present: list[str], pattern: str, config: Any, stride: Stride = 1) -> ColumnParallel:
    """A ``colwise`` layer: a key/value projection of grouped-query attention (as wide as the
    key/value heads, fewer than the query heads) is :class:`KeyValueColumnParallel`; a packed one
    is split with its ``stride`` (:mod:`~megatron_slapo.plans.gathered_outputs`)."""
    if stride != 1:
        return ColumnParallel(stride=stride, reduce_input_grad=False)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    path = next(p for p in present if compile_pattern(pattern).match(p))
    layer, parent = model.get_submodule(path), model.get_submodule(path.rpartition(".")[0])
    if heads and kv and kv < heads and core_kind(parent) is not None:  # in an attention module
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if getattr(layer, "out_features", None) == kv * head_dim:
            return KeyValueColumnParallel(kv_heads=kv, head_dim=head_dim)
    return ColumnParallel(reduce_input_grad=False)


def _scalar_holders(region: nn.Module) -> list[str]:
    """The activations of a region with learnable single-number parameters (Apertus' xIELU slopes,
    classes of ``transformers.activations``): an activation runs on the column-parallel layers'
    split output, so those parameters' gradients are partial sums, reduced over the ranks as
    Megatron reduces a norm's weights under sequence parallelism. Any other parameter the plan
    leaves whole in a region stays for ``check_regions`` to refuse by name."""
    return [path for path, module in region.named_modules()
            if path and type(module).__module__ == "transformers.activations"
            and (params := list(module.parameters(recurse=False))) and all(p.numel() == 1 for p in params)]  # fmt: skip


def _fusable(module: nn.Module, children: list[str]) -> str:
    """The region's column-parallel children to multiply as one GEMM (``"{q_proj,k_proj,v_proj}"``),
    when they can be (:func:`~megatron_slapo.kernels.shared_input.why_not_fused`)."""
    return "" if why_not_fused(module, children) else "{" + ",".join(children) + "}"


def _parents(present: list[str], pattern: str) -> list[str]:
    """The modules holding those ``pattern`` matches, as one pattern (its parent's) where that
    matches just them, else as paths: an MoE model may have the dense MLP in some layers only."""
    regex, parent = compile_pattern(pattern), pattern.rpartition(".")[0]
    holders = [p.rpartition(".")[0] for p in present if regex.match(p)]
    return [parent] if holders == [p for p in present if compile_pattern(parent).match(p)] else holders


def _within(present: list[str], pattern: str, modules: list[str]) -> bool:
    """Whether every module ``pattern`` matches lies inside one of ``modules``."""
    regex = compile_pattern(pattern)
    matched = [p for p in present if regex.match(p)]
    return bool(matched) and all(any(p.startswith(m + ".") for m in modules) for p in matched)


def _final_norm(base: nn.Module, prefix: str, pp_plan: dict) -> str | None:
    """The module after the layers: the last entry of the config's ``base_model_pp_plan``, or
    (configs without one) the base model's last child named as a norm."""
    last = list(pp_plan)[-1] if pp_plan else None
    if last and last != "layers":
        return f"{prefix}{last}"
    norms = [name for name, _ in base.named_children() if "norm" in name or name == "ln_f"]
    return f"{prefix}{norms[-1]}" if norms else None


def check_regions(sch: Schedule, plan: dict[str, Any]) -> None:
    """SchedulingError if a module inside a tensor-parallel region (an attention block, an MLP) that
    the plan does not place holds a parameter not tagged for summed gradients: it sees only this
    rank's heads or features, and the plan says nothing of it (Phi's q/k layer norms)."""
    regions = [p for p, v in plan.items() if any(isinstance(x, ParallelRegionInput) for x in placements_of(v))]
    for pattern in regions:
        for path in matching(sch, pattern):
            for sub, node in sch[path].named_schedules():
                if node.metadata.shards:  # placed by the plan (a row-parallel bias is added after the reduction)
                    continue
                for name, param in node.mod.named_parameters(recurse=False):
                    if not getattr(param, "sequence_parallel", False):
                        where = ".".join(x for x in (path, sub, name) if x)
                        raise SchedulingError(f"--schedule auto: {where} is replicated inside a tensor-parallel "
                                              "region and the plan neither splits it nor sums its gradient")  # fmt: skip
