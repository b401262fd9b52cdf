"""Named, model-specific schedules. ``--schedule NAME`` applies ``SCHEDULES[NAME].apply(sch, config, args)``.

Each module is a few lines: a tensor-parallel plan (see ``megatron_slapo/plans/styles.py``) and
whatever primitives the model needs beyond sharding. Add a schedule by writing the module and
adding it here (and to :data:`SINGLE_DEVICE` if it splits nothing). Without ``--schedule``, a run
at TP size > 1 gets the tensor-parallel schedule written for its model type (:func:`default_for`).
"""

import textwrap
from types import ModuleType

from megatron_slapo.errors import ConfigError
from schedules import auto, bert_tp, default, gpt_fused, gpt_neo_tp, gpt_tp, llama_tp, opt_tp, t5_tp, wideresnet_tp
from schedules.refusal import unverified_message

SCHEDULES: dict[str, ModuleType] = {
    "default": default,
    "gpt_tp": gpt_tp,
    "gpt_fused": gpt_fused,
    "gpt_neo_tp": gpt_neo_tp,
    "opt_tp": opt_tp,
    "llama_tp": llama_tp,
    "bert_tp": bert_tp,
    "t5_tp": t5_tp,
    "wideresnet_tp": wideresnet_tp,
    "auto": auto,
}


def get_schedule(name: str) -> ModuleType:
    """The schedule module called ``name``; ConfigError listing the known ones otherwise."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; available: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def fitting(model_type: str) -> list[str]:
    """The schedules that can be applied to a model of this HF ``model_type``."""
    return [name for name, mod in SCHEDULES.items() if mod.MODEL_TYPES is None or model_type in mod.MODEL_TYPES]


# The schedules that split nothing (the model on each rank whole: data parallelism only, TP size 1).
# Every other schedule written for a model type is that type's tensor-parallel schedule.
SINGLE_DEVICE = frozenset({"default", "gpt_fused"})


def tensor_parallel_for(model_type: str) -> str | None:
    """The tensor-parallel schedule written for ``model_type`` (the first in :data:`SCHEDULES`
    whose ``MODEL_TYPES`` name it, ``auto`` aside); None if it has none."""
    written = (name for name, mod in SCHEDULES.items() if name not in SINGLE_DEVICE and mod is not auto)
    return next((name for name in written if model_type in SCHEDULES[name].MODEL_TYPES), None)


def verified(model_type: str) -> bool:
    """Whether a schedule that splits ``model_type`` is verified on it: one written for it, or
    ``auto``, which lists the families it is checked on. The others are refused wherever the run
    needs its model split (:mod:`schedules.refusal`)."""
    return model_type in auto.MODEL_TYPES or tensor_parallel_for(model_type) is not None


def default_for(model_type: str, tensor_parallel: int, expert_parallel: int = 1) -> str:
    """The schedule a run gets without ``--schedule``. Under tensor parallelism: the family's own
    tensor-parallel schedule (gpt2 -> gpt_tp, ...), else ``auto`` for a family it is verified on;
    else (and at TP size 1) ``default``, the model as it is, data-parallel: a family no schedule
    is verified on is then refused, saying why (:mod:`schedules.refusal`). Under expert
    parallelism ``auto``, the schedule that places experts, for the families it is verified on."""
    if expert_parallel > 1 and model_type in auto.MODEL_TYPES:
        return "auto"
    if tensor_parallel <= 1:
        return "default"
    own = tensor_parallel_for(model_type)
    return own or ("auto" if model_type in auto.MODEL_TYPES else "default")


def _listed(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def written_for_others(name: str, model_type: str) -> str | None:
    """Why schedule ``name`` does not fit ``model_type`` ("--schedule NAME is for ... models, not
    MODEL_TYPE") when it is written for other model types; None when it fits."""
    types = get_schedule(name).MODEL_TYPES
    if types is None or model_type in types:
        return None
    return f"--schedule {name} is for {_listed(types)} models, not {model_type}"


def check_fits(name: str, model_type: str) -> None:
    """ConfigError (before any model is built) when schedule ``name`` is written for other model
    types; ``auto`` on a family nothing is verified on gets :func:`~schedules.refusal.unverified_message`."""
    other = written_for_others(name, model_type)
    if other is None:
        return
    if name == "auto" and not verified(model_type):
        raise ConfigError(unverified_message(model_type, "--schedule auto"))
    raise ConfigError(f"{other}; schedules that fit {model_type}: {', '.join(fitting(model_type))}")


def describe() -> str:
    """One line per schedule: its name, the model types it is for, and the first line of its
    docstring; a schedule for many types (``auto``'s verified families) counts them there and lists
    them on the lines below."""
    lines = []
    for name, mod in SCHEDULES.items():
        types = mod.MODEL_TYPES or ("any",)
        listed = ", ".join(types) if len(types) <= 3 else f"{len(types)} families"
        lines.append(f"{name:13s} {listed:21s} {(mod.__doc__ or '').strip().splitlines()[0]}")
        if len(types) > 3:
            lines += textwrap.wrap(", ".join(types), width=100, initial_indent=" " * 14, subsequent_indent=" " * 14)
    return "\n".join(lines)
