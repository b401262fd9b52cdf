"""Pipeline partitioning: split a traced model at ``cut_pipeline_stage`` marks into stage modules.

``sch["transformer.h.2"].cut_pipeline_stage()`` says "a new stage starts at this module". The
partitioner takes the traced root graph, inlines the traced levels between the root and each cut
(so all cuts lie in one graph), assigns every node to a stage, and builds one GraphModule per
stage. A liveness pass decides what crosses each cut: every value computed before the cut and used
after it (model inputs such as the attention mask included) is an output of the stage before and an
input of the stage after; values only passing through are forwarded, and values derived from the
model's inputs alone may instead be recomputed by each stage (``recompute_inputs``). Weights used by
several stages (tied embeddings) are reported, because the engine must keep their copies in sync.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch import nn

from megatron_slapo.compat.torch_nn import backward_hooks, backward_pre_hooks, forward_hooks, forward_pre_hooks
from megatron_slapo.errors import SchedulingError
from megatron_slapo.graph_edit import graph_order, inline
from megatron_slapo.kernels.subgraph import SubgraphModule
from megatron_slapo.pipeline_inputs import Derivation, input_derived, stand_in
from megatron_slapo.primitives.sync import InputSync, OutputSync
from megatron_slapo.tracing import CallGuard

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule


@dataclass
class StagePlan:
    """Where the cuts are, as the partitioner saw them."""

    cut_paths: list[str]  # module paths (from the root) that start stages 1, 2, ...
    crossing: list[list[str]]  # names of the values crossing each cut
    tied: dict[str, list[int]]  # a parameter used by several stages -> those stages
    recompute_inputs: bool = False  # stages after the first also take the model's inputs


class PipelineStages(nn.Module):
    """The stage modules of a pipeline, and (for checking) their composition as one model.

    ``stages[i]`` takes the values crossing cut ``i - 1`` (stage 0 takes the model inputs) and
    returns the values crossing cut ``i`` as a tuple (the last stage returns the model output).
    """

    def __init__(self, stages: list[fx.GraphModule], plan: StagePlan) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.plan = plan

    def local(self, pp_rank: int, pp_size: int) -> list[tuple[int, nn.Module]]:
        """The stages pipeline rank ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp_size``, ... (Megatron's
        interleaving: with ``V`` stages per rank, virtual stage ``v`` of rank ``r`` is stage ``v * P + r``)."""
        return [(k, stage) for k, stage in enumerate(self.stages) if k % pp_size == pp_rank]

    def later_inputs(self, *args: Any, **kwargs: Any) -> tuple:
        """What every stage after the first takes before the values crossing its cut: with
        ``recompute_inputs``, the model's inputs in the order of stage 0's placeholders (without
        the traced-in constants, which stage 0's guard checked); else nothing."""
        if not self.plan.recompute_inputs:
            return ()
        signature = inspect.signature(self.stages[0].forward)
        traced = {k: v for k, v in kwargs.items() if k in signature.parameters}
        bound = signature.bind(*args, **traced)
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self.stages[0](*args, **kwargs)
        inputs = self.later_inputs(*args, **kwargs)
        for stage in self.stages[1:]:
            values = stage(*inputs, *values)
        return values


def _flat_root(sch: Schedule, cut_paths: list[str]) -> fx.GraphModule:
    """The root graph with every traced level on the way to a cut inlined (modules are shared)."""
    if not isinstance(sch.mod, fx.GraphModule):
        raise SchedulingError("pipeline cuts need a traced model: trace() the root schedule first")
    _refuse_dropped(sch)
    flat = fx.GraphModule(sch.mod, copy.deepcopy(sch.mod.graph), "Flat" + type(sch.mod).__name__)
    for path in cut_paths:
        while not any(n.op == "call_module" and n.target == path for n in flat.graph.nodes):
            caller = next(
                (n for n in flat.graph.nodes if n.op == "call_module" and path.startswith(f"{n.target}.")), None
            )
            if caller is None or not isinstance(flat.get_submodule(caller.target), fx.GraphModule):
                raise SchedulingError(f"[{path}] cut_pipeline_stage: no traced level calls this module")
            _refuse_dropped(sch[caller.target])
            try:
                inline(flat, caller)
            except ValueError as e:
                raise SchedulingError(f"[{path}] cannot partition at this cut: {e}") from e
    flat.graph.lint()
    flat.recompile()
    return flat


def _refuse_dropped(level: Schedule) -> None:
    """Refuse what the partitioner would silently drop from a traced level it takes apart (the root,
    and each level it inlines on the way to a cut): the stages run that level's graph nodes, never
    the module itself, so its hooks (``sync`` included) and forward wrappers would not run. Its call
    guard is not lost: the root's checks stage 0's inputs, and inlined levels' inputs are internal."""
    module, meta = level.mod, level.metadata
    found = [f"sync({mode!r}, {getattr(op, '__name__', op)!r})" for mode, op in sorted(meta.syncs, key=repr)]
    if meta.checkpointed:
        found.append("checkpoint()")
    if meta.forked_rng:
        found.append("fork_rng()")
    registered = (*forward_pre_hooks(module).values(), *forward_hooks(module).values(),
                  *backward_pre_hooks(module).values(), *backward_hooks(module).values())  # fmt: skip
    hooks = [h for h in registered if not isinstance(h, (CallGuard, InputSync, OutputSync))]  # syncs: listed above
    if hooks:
        found.append(f"{len(hooks)} hook(s)")
    if "forward" in module.__dict__ and not (meta.checkpointed or meta.forked_rng):
        found.append("a replaced forward")
    if found:
        raise SchedulingError(
            f"[{level.path or '<root>'}] {', '.join(found)} on this traced level would be dropped by pipeline "
            "partitioning: the stages run the nodes of its graph, not the module; apply them to a module "
            "the stages call (a transformer layer, the embedding, the head)"
        )


def _assign_stages(graph: fx.Graph, cut_paths: list[str]) -> dict[fx.Node, int]:
    starts = {
        next(n for n in graph.nodes if n.op == "call_module" and n.target == path): i + 1
        for i, path in enumerate(cut_paths)
    }
    stage_of: dict[fx.Node, int] = {}
    current = 0  # cut_paths come sorted by execution order (see partition)
    for node in graph.nodes:
        current = max(current, starts.get(node, 0))
        stage_of[node] = current
    return stage_of


def _live_across(graph: fx.Graph, stage_of: dict[fx.Node, int], boundary: int, recompute: Derivation) -> list[fx.Node]:
    """Values computed before stage ``boundary`` and used in it or later, recomputable ones excepted.

    A use by a recomputable node does not count: such a node reads a value that is not recomputable
    only for its device and dtype, which a recomputing stage takes from a stand-in.
    """
    return [
        n for n in graph.nodes
        if n.op not in ("get_attr", "output") and stage_of[n] < boundary and n not in recompute
        and any(stage_of[u] >= boundary and u not in recompute for u in n.users)
    ]  # fmt: skip


def _stage_module(flat: fx.GraphModule, stage: int, stage_of: dict, inputs: list[fx.Node],
                  outputs: list[fx.Node] | None, recompute: Derivation) -> fx.GraphModule:  # fmt: skip
    """One stage's graph. Values in ``recompute`` that the stage needs but was not handed are
    recomputed from its inputs (which then include the model's inputs)."""
    graph, env = fx.Graph(), {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
    anchor = env[inputs[-1]] if inputs else None  # the received activation (last input) for metadata reads

    def fetch(node: fx.Node) -> fx.Node:
        if node not in env:
            if node not in recompute:
                raise SchedulingError(
                    f"stage {stage} needs {node.name}, which neither crosses the cut nor is recomputable"
                )
            env[node] = copy_node(node)
        return env[node]

    def copy_node(node: fx.Node) -> fx.Node:
        def argument(value: fx.Node) -> fx.Node:
            if value in env or value in recompute or node not in recompute:
                return fetch(value)
            # A recomputed node reads only the device and dtype of this value (see pipeline_inputs).
            if anchor is None:
                raise SchedulingError(f"stage {stage} cannot recompute {node.name}: it received no activation")
            described = recompute.stand_ins.get((node, value))
            return anchor if described is None else stand_in(graph, anchor, described)

        return graph.node_copy(node, argument)

    for node in flat.graph.nodes:
        if node in env or node.op == "output":
            continue
        if stage_of[node] == stage or (node.op == "get_attr" and any(stage_of[u] == stage for u in node.users)):
            env[node] = copy_node(node)
    if outputs is None:
        final = next(n for n in flat.graph.nodes if n.op == "output")
        graph.output(fx.node.map_arg(final.args[0], fetch))
    else:
        graph.output(tuple(fetch(n) for n in outputs))
    stage_module = fx.GraphModule(flat, graph, f"Stage{stage}")
    for path in _subgraph_targets(flat, graph):  # layers that only a subgraph module calls
        _attach(stage_module, path, _lookup(flat, path))
    return stage_module


def _subgraph_targets(flat: fx.GraphModule, graph: fx.Graph) -> set[str]:
    paths = set()
    for node in graph.nodes:
        module = flat.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, SubgraphModule):
            prefix = node.target.rpartition(".")[0]
            paths |= {f"{prefix}.{t}" if prefix else t for t in module.targets() if t != "training"}
    return paths


def _lookup(root: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, name)


def _attach(root: nn.Module, path: str, value: Any) -> None:
    *parents, name = path.split(".")
    module = root
    for part in parents:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if not hasattr(module, name):
        setattr(module, name, value)


def _tied(stages: list[fx.GraphModule]) -> dict[str, list[int]]:
    owners: dict[int, tuple[str, list[int]]] = {}
    for i, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            _, used = owners.setdefault(id(p), (name, []))
            if i not in used:
                used.append(i)
    return {name: used for name, used in owners.values() if len(used) > 1}


def partition(sch: Schedule, recompute_inputs: bool = False) -> PipelineStages:
    """Split the traced root of ``sch`` at its ``cut_pipeline_stage`` marks.

    With ``recompute_inputs``, values derived from the model's inputs alone (attention masks,
    position ids, rotary cos/sin: see :mod:`megatron_slapo.pipeline_inputs`) do not cross the cuts:
    every stage takes the model's inputs plus the activations that do cross, and recomputes the
    rest. Megatron's pipeline schedules need that form: they send one activation tensor between
    stages and hand every stage the micro-batch.

    Hooks, syncs and forward wrappers on the root or on a level inlined on the way to a cut are
    refused (:class:`SchedulingError`): the stages run those levels' graph nodes, so they would be
    dropped silently.
    """
    cut_paths = [path for path, node in sch.named_schedules() if node.metadata.pipeline_cut]
    flat = _flat_root(sch, cut_paths)
    order = graph_order(flat.graph)
    cut_paths.sort(key=lambda p: order[next(n for n in flat.graph.nodes if n.op == "call_module" and n.target == p)])
    stage_of = _assign_stages(flat.graph, cut_paths)
    placeholders = [n for n in flat.graph.nodes if n.op == "placeholder"]
    recompute = input_derived(flat) if recompute_inputs else Derivation()
    boundaries = [_live_across(flat.graph, stage_of, k + 1, recompute) for k in range(len(cut_paths))]
    stages = []
    for k in range(len(cut_paths) + 1):
        inputs = placeholders if k == 0 else (placeholders if recompute_inputs else []) + boundaries[k - 1]
        outputs = boundaries[k] if k < len(cut_paths) else None
        stages.append(_stage_module(flat, k, stage_of, inputs, outputs, recompute))
    crossing = [[n.name for n in b] for b in boundaries]
    for hook in forward_pre_hooks(sch.mod).values():  # stage 0 takes the model's inputs: same guard
        if isinstance(hook, CallGuard):
            stages[0].register_forward_pre_hook(hook, with_kwargs=True)
    pipeline = PipelineStages(stages, StagePlan(cut_paths, crossing, _tied(stages), recompute_inputs))
    pipeline.train(sch.mod.training)
    return pipeline
