"""Which of the size flags a model family built from them takes: one it has no place for is refused.

``config_from_flags`` builds Megatron's own families (GPT-2, GPT-Neo, OPT, Llama, BERT, RoBERTa,
ALBERT, T5) from the fields their configs name, and any other transformers family from its config
class's defaults with the optional flags in the fields it has (:data:`SCALED_DOWN_FIELDS`). A flag
given for a family with no such field would change nothing, silently: ``--num-query-groups 2`` on
GPT-2, whose every head has its own keys and values, would train a model with as many key/value
heads as heads. :func:`flags_not_taken` names each such flag, what the family lacks and what to do,
for validation's one line (the MoE flags have their own check there).
"""

from __future__ import annotations

import argparse
from typing import Any

import transformers

from megatron_slapo.arguments.chosen import user_gave
from megatron_slapo.arguments.parser import build_parser

# The optional flags a family built from its config class's defaults takes, by the field each sets
SCALED_DOWN_FIELDS = {
    "ffn_hidden_size": "intermediate_size", "num_query_groups": "num_key_value_heads",
    "attention_dropout": "attention_dropout", "hidden_dropout": "hidden_dropout", "init_method_std": "initializer_range",
}  # fmt: skip
# The flags that Megatron's own families' configs have no field for (config_from_flags.CONFIGS' types)
NOT_IN_MEGATRON_FAMILY = {
    "gpt2": ("num_query_groups",), "gpt_neo": ("num_query_groups",), "opt": ("num_query_groups",),
    "llama": ("hidden_dropout",), "bert": ("num_query_groups",), "roberta": ("num_query_groups",),
    "albert": ("num_query_groups",),
    # T5's --num-query-groups is refused with T5's other limits (validation._check_language_pairs)
    "t5": ("max_position_embeddings", "attention_dropout", "init_method_std"),
}  # fmt: skip
# What a family without the flag's field lacks, and what to do instead
_LACKS = {
    "num_query_groups": ("has no grouped-query attention (each head has its own keys and values)",
                         "drop it, or give a --model-type that has it (llama, mistral, qwen3, ...)"),
    "ffn_hidden_size": ("takes no FFN width from the flags (its config has no intermediate_size)",
                        "drop it, or give --hf-config with the width you want"),
    "max_position_embeddings": ("has no position embeddings to size (a relative position bias)",
                                "drop it: --seq-length sets the length"),
    "attention_dropout": ("has no attention dropout", "drop it"),
    "hidden_dropout": ("has no dropout on its hidden states", "drop it (or give 0)"),
    "init_method_std": ("initialises its weights by its own rule (its config has no initializer_range)", "drop it"),
}  # fmt: skip
_DROPOUTS = ("attention_dropout", "hidden_dropout")


def _fields_missing(kind: str, names: list[str]) -> list[str]:
    """Those of the flags ``names`` that the config of ``kind`` (not one of Megatron's families) has
    no field for."""
    if kind not in transformers.CONFIG_MAPPING:
        return []  # an unknown --model-type is refused on its own
    try:
        default = transformers.CONFIG_MAPPING[kind]()
        return [name for name in names if not hasattr(default, SCALED_DOWN_FIELDS[name])]
    except Exception:  # a config that cannot be built with its defaults, or reads a field per layer: said later
        return []


def _given(args: argparse.Namespace, name: str, default: Any) -> bool:
    """Whether the user chose a value for flag ``name`` other than its ``default`` (not the embedded
    run or the checkpoint in ``--load``). A dropout of 0 asks for none, which a family without that
    dropout already has."""
    value = getattr(args, name, None)
    if name in _DROPOUTS and value == 0:
        return False
    return user_gave(args, name) and value != default


def flags_not_taken(args: argparse.Namespace) -> list[str]:
    """One sentence per flag given that the model the size flags build cannot take: its value,
    what the family lacks and what to do. None when an ``--hf-config`` / ``--load-hf`` config
    shapes the model (its own fields do), or for an image model."""
    if args.task == "vision" or args.hf_config or args.load_hf:
        return []
    kind, defaults = args.model_type, build_parser(args.task)
    names = NOT_IN_MEGATRON_FAMILY.get(kind, tuple(SCALED_DOWN_FIELDS))
    given = [name for name in names if _given(args, name, defaults.get_default(name))]
    not_taken = given if kind in NOT_IN_MEGATRON_FAMILY or not given else _fields_missing(kind, given)
    return [f"--{name.replace('_', '-')} {getattr(args, name):g}: {kind} {_LACKS[name][0]}; {_LACKS[name][1]}"
            for name in not_taken]  # fmt: skip
