"""The refusal of a family that no schedule is verified on, when the run needs one that splits it.

A family is verified when ``--schedule auto`` lists it (:data:`schedules.auto.MODEL_TYPES`, each
checked against its unscheduled model) or a schedule is written for it (``llama_tp``, ...). A run
of any other family that needs its model split (``--tensor-model-parallel-size`` > 1,
``--expert-model-parallel-size`` > 1, or ``--schedule auto`` named) is refused in one line that
says three things:

- that ``--schedule auto`` has not verified the family yet;
- what stops auto on it, found by auto's own checks (:func:`what_stops_auto`): HF's plan style it
  cannot honour, the module it refuses, a config without a plan; or, when they pass, that its plan
  runs but is not checked against the unscheduled model, and what it splits;
- what the user can do instead: the model whole on every rank (``--schedule default``, at the
  sizes where default runs), an engine that shards memory over the data-parallel ranks, or a
  schedule of their own (:data:`WRITING_A_SCHEDULE`). Never ``default`` at a layout it cannot run.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from torch import nn

from megatron_slapo.build import validate
from megatron_slapo.errors import ConfigError, SchedulingError
from megatron_slapo.schedule import create_schedule
from schedules import auto

# The page that explains writing a schedule for a new family
WRITING_A_SCHEDULE = "docs/schedules.md"


def what_stops_auto(model: nn.Module, args: argparse.Namespace | None = None) -> str:
    """What ``--schedule auto`` makes of ``model``'s family at this process's tensor-parallel size,
    from its own checks: its plan applied to a schedule of ``model``, then validated as ``build``
    does. ``model`` (on the meta device, built for this) is scheduled in place: pass a throwaway.
    The answer completes "--schedule auto has not verified X yet ...". An exception other than a
    refusal is reported too, by type: the family is unverified, and the run is refused either way."""
    sch = create_schedule(model)
    try:
        auto.apply(sch, model.config, args)
        validate(sch)
    except (SchedulingError, ConfigError) as e:
        return f", and cannot run it: {str(e).removeprefix('--schedule auto: ')}"
    except Exception as e:  # noqa: BLE001 (an unverified family's plan may break anywhere: say how)
        return f", and its plan fails on it ({': '.join(x for x in (type(e).__name__, str(e)) if x)})"
    return f" (its plan runs, but is not checked against the unscheduled model: {_what_is_split(model, sch)})"


def _what_is_split(model: nn.Module, sch: Any) -> str:
    """The parts of ``model`` that schedule ``sch`` shards: the embedding, the LM head, and in each
    layer the modules holding sharded weights (``self_attn``, ``mlp``, ...)."""
    special = {id(model.get_input_embeddings()): "the embedding", id(model.get_output_embeddings()): "the LM head"}
    named, in_layers = [], []
    for path, node in sch.named_schedules():
        if not (node.metadata.shards or node.metadata.expert_shards):
            continue
        if id(node.mod) in special:
            named.append(special[id(node.mod)])
        elif layer := re.match(r".*?\.\d+\.([^.]+)", path):
            in_layers.append(layer.group(1))
        else:
            named.append(path)
    parts = list(dict.fromkeys(named)) + [f"each layer's {p}" for p in dict.fromkeys(in_layers)]
    if not parts:
        return "it splits nothing"
    listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return f"it splits {'' if in_layers else 'only '}{listed}"


def unverified_message(model_type: str, needs: str, why: str = "", args: argparse.Namespace | None = None) -> str:
    """The one-line refusal of an unverified ``model_type``: ``needs`` is what asks for a splitting
    schedule (``"--tensor-model-parallel-size 2"``, ``"--schedule auto"``), ``why`` the answer of
    :func:`what_stops_auto` ("" where no model is at hand), ``args`` the run's layout, from which
    the remedies are chosen (None, a layout not known: they name the tensor-parallel size 1)."""
    tp, ep, pp = (getattr(args, f"{kind}_model_parallel_size", 1) for kind in ("tensor", "expert", "pipeline"))
    resets = [f"--{kind}-model-parallel-size 1" for kind, size in (("tensor", tp), ("expert", ep)) if size > 1]
    if args is None:
        resets = ["--tensor-model-parallel-size 1"]
    dropped = ", no --sequence-parallel" if getattr(args, "sequence_parallel", False) else ""
    unpipelined = ["--pipeline-model-parallel-size 1"] if pp > 1 else []  # whole on every rank; no engine pipelines
    whole = " ".join([*resets, *unpipelined, "--schedule default"]) + dropped
    context_parallel = getattr(args, "context_parallel_size", 1) > 1  # which DeepSpeed refuses
    engines = "--engine fsdp" + ("" if context_parallel else ", or --engine deepspeed --zero-stage 3")
    sharded = " ".join([*resets, *unpipelined, engines]) + dropped
    asked = "" if needs == "--schedule auto" else f"{needs} needs a schedule that splits {model_type}: "
    return (
        f"{asked}--schedule auto has not verified {model_type} yet{why}. What you can do: train it whole on every "
        f"rank, data-parallel ({whole}); shard its weights and optimizer state over the data-parallel ranks "
        f"instead ({sharded}); or write a schedule for {model_type} ({WRITING_A_SCHEDULE})"
    )
