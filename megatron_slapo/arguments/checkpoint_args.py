"""The model's flags from the checkpoint a run loads, as Megatron's ``--use-checkpoint-args`` takes them.

A checkpoint records the arguments of the run that saved it. A run whose ``--load`` holds one and
that was given none of the size flags (nor ``--hf-config`` / ``--load-hf``) takes the model from
there: every flag that shapes it and was not given (the size flags, or, for a model an HF config
shaped, that config: the checkpoint directory becomes the run's ``--hf-config``), the sequence
length, and, for a run on data of its own given no tokenizer flag, the tokenizer. So ``--load DIR
--finetune`` trains the model in DIR, whatever its size. With ``--use-checkpoint-args`` (Megatron's
flag) every such flag not given is taken, whatever was given, and a ``--load`` holding no checkpoint
yet is refused rather than started afresh. A flag given keeps its value: one that contradicts the
checkpoint is refused when the checkpoint is read, as a checkpoint of another model is
(``checkpoints/saved_model.py``). The values taken are listed in ``args.checkpoint_defaults``, so
that an error never blames the user for them.

This package reads no checkpoint: the caller passes the record (``training/plan.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from megatron_slapo.arguments.chosen import user_gave
from megatron_slapo.arguments.parser import EMBEDDED_MODEL_SHAPE, MOE_FLAGS
from megatron_slapo.arguments.validation import default_model_type
from megatron_slapo.errors import ConfigError

# The flags that shape a model, which a checkpoint supplies when they are not given
LANGUAGE_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                        *MOE_FLAGS, "seq_length", "max_position_embeddings", "decoder_seq_length")  # fmt: skip
VISION_MODEL_FLAGS = ("resnet_layers", "width_per_group", "base_channels", "img_h", "img_w")
# What a checkpoint whose model an HF config shaped supplies beside that config: the inputs' sizes
CONFIG_MODEL_FLAGS = ("seq_length", "decoder_seq_length", "img_h", "img_w")
# Given any of these, the user shapes the model: the checkpoint supplies the rest only with --use-checkpoint-args
SIZE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "resnet_layers", "width_per_group", "base_channels")
# The tokenizer of a run's own data: the checkpoint's, when none of these is given
TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")


def _take(args: argparse.Namespace, recorded: Mapping[str, Any], names: tuple[str, ...]) -> list[str]:
    """Set each flag of ``names`` not given that ``recorded`` has a value for; return them as ``--flag value``."""
    taken = []
    for name in names:
        value = recorded.get(name)
        if value is None or user_gave(args, name) or not hasattr(args, name):
            continue
        setattr(args, name, value)
        args.embedded_defaults.pop(name, None)
        args.checkpoint_defaults[name] = value
        taken.append(f"--{name.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return taken


def _shaped_by_config(args: argparse.Namespace, checkpoint: str) -> list[str]:
    """A model an HF config shaped: the checkpoint's recorded config (``--hf-config CHECKPOINT``), in
    place of the embedded run's shape, as parse_args leaves the shape to an ``--hf-config``."""
    for name in EMBEDDED_MODEL_SHAPE:
        if args.embedded_defaults.pop(name, None) is not None:
            setattr(args, name, None)
    args.hf_config = args.checkpoint_defaults["hf_config"] = checkpoint
    return [f"--hf-config {checkpoint}"]


def take_model_flags(args: argparse.Namespace, recorded: Mapping[str, Any], checkpoint: str) -> list[str]:
    """Set the flags shaping the model that ``args`` was not given from ``recorded``, the arguments
    recorded by the checkpoint in ``--load`` ``checkpoint`` (a run of the same ``pretrain_*.py``);
    return them as ``--flag value``, for the start-up line. Nothing is taken when the user gave a
    size flag (without ``--use-checkpoint-args``) or an ``--hf-config`` / ``--load-hf``."""
    task = recorded.get("task", args.task)
    if task != args.task:
        raise ConfigError(f"--load {checkpoint} holds a checkpoint of pretrain_{task}.py, not of "
                          f"pretrain_{args.task}.py: load it with pretrain_{task}.py, or give another --load")  # fmt: skip
    vars(args).setdefault("checkpoint_defaults", {})
    by_config = user_gave(args, "hf_config") or user_gave(args, "load_hf")
    if by_config or (not args.use_checkpoint_args and any(user_gave(args, name) for name in SIZE_FLAGS)):
        return []
    if recorded.get("hf_config") or recorded.get("load_hf"):
        taken = [*_shaped_by_config(args, checkpoint), *_take(args, recorded, CONFIG_MODEL_FLAGS)]
    else:
        kind = recorded.get("model_type")
        taken = _take(args, recorded, VISION_MODEL_FLAGS if args.task == "vision" else LANGUAGE_MODEL_FLAGS)
        if kind and args.model_type == default_model_type(args.task) != kind:  # the default yields, as to --hf-config
            args.model_type = args.checkpoint_defaults["model_type"] = kind
            taken.insert(0, f"--model-type {kind}")
    if not args.embedded_data and args.task != "vision" and not any(user_gave(args, n) for n in TOKENIZER_FLAGS):
        taken += _take(args, recorded, TOKENIZER_FLAGS)
    return taken
