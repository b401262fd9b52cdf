"""Named, model-specific schedules. ``--schedule NAME`` applies ``SCHEDULES[NAME].apply(sch, config, args)``.

Each module is a few lines: a tensor-parallel plan (see ``megatron_slapo/parallel/plans.py``) and
whatever primitives the model needs beyond sharding. Add a schedule by writing the module and
adding it here.
"""

from types import ModuleType

from megatron_slapo.errors import ConfigError
from schedules import bert_tp, default, gpt_neo_tp, gpt_tp, llama_tp, opt_tp

SCHEDULES: dict[str, ModuleType] = {
    "default": default,
    "gpt_tp": gpt_tp,
    "gpt_neo_tp": gpt_neo_tp,
    "opt_tp": opt_tp,
    "llama_tp": llama_tp,
    "bert_tp": bert_tp,
}


def get_schedule(name: str) -> ModuleType:
    """The schedule module called ``name``; ConfigError listing the known ones otherwise."""
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; available: {', '.join(SCHEDULES)}")
    return SCHEDULES[name]


def describe() -> str:
    """One line per schedule: its name and the first line of its docstring."""
    return "\n".join(f"{name:12s} {(mod.__doc__ or '').strip().splitlines()[0]}" for name, mod in SCHEDULES.items())
