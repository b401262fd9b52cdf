"""What a checkpoint records of the model it holds, and the refusal of a run whose model is another.

Besides its tensors, every checkpoint records the arguments of the run that saved it (Megatron's
``args`` entry: the flags as that run used them, its model's depth, width and heads among them) and
its export metadata (the HF config, the vocabulary, the tied weights). :class:`SavedModel` is that
record, read without the tensors (:func:`~megatron_slapo.checkpoints.checkpointing.read_saved_model`):
a run with ``--load`` takes from it the model's flags it was not given (Megatron's
``--use-checkpoint-args``: ``arguments/checkpoint_args.py``), and ``--hf-config`` of a checkpoint
directory builds the model its HF config describes.

:func:`check_same_model` refuses, before anything is built, a run whose model is not the
checkpoint's in what no tensor's shape tells apart (the family, the depth, the heads and key/value
heads), in one line naming each difference and the flag that fits the checkpoint; a width that
differs is named by the first tensor whose shape differs, when the tensors are loaded (or, for
``tools/explain.py``, compared: ``dist_checkpoint.check_model_shapes``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import transformers

from megatron_slapo.errors import CheckpointError

# What a run's model must share with the checkpoint's: (config field, the flag that sets it, how the checkpoint's
# value reads); the checkpoint's HF config, when recorded, else the saving run's arguments (their name for it)
_SAME = (
    ("model_type", "model_type", "--model-type", "a {} model"),
    ("num_hidden_layers", "num_layers", "--num-layers", "a model of {} layers"),
    ("num_attention_heads", "num_attention_heads", "--num-attention-heads", "a model of {} attention heads"),
    ("num_key_value_heads", "num_query_groups", "--num-query-groups", "a model of {} key/value heads"),
)


def hf_config(metadata: Mapping[str, Any], vocab_size: int | None = None) -> transformers.PretrainedConfig:
    """The saved model's HF config (``metadata``: the checkpoint's export metadata), its vocabulary
    ``vocab_size`` rows (default: the true vocabulary)."""
    config_dict = json.loads(metadata["hf_config"])
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    if metadata["vocab"]["true"] is not None:  # image models have no vocabulary
        config.vocab_size = vocab_size or metadata["vocab"]["true"]
    return config


@dataclass(frozen=True)
class SavedModel:
    """A checkpoint's record of its model: ``path`` names it in problems (a ``torch_dist`` iteration
    directory, or a ``torch`` checkpoint's rank file), ``args`` are the saving run's arguments and
    ``metadata`` its export metadata (:func:`~megatron_slapo.checkpoints.checkpointing.export_metadata`)."""

    path: str
    args: dict[str, Any]
    metadata: dict[str, Any]

    @classmethod
    def of(cls, path: str, state: Mapping[str, Any]) -> SavedModel:
        """The record in ``state``, a ``torch_dist`` checkpoint's common state or a ``torch`` one's file."""
        args = json.loads(state["args"]) if isinstance(state.get("args"), str) else {}
        return cls(path, args, dict(state.get("slapo") or {}))

    @property
    def shaped_by_config(self) -> bool:
        """Whether an HF config shaped the model (``--hf-config``, ``--load-hf``, a ``from-hf``
        conversion), rather than the size flags."""
        return bool(self.args.get("hf_config") or self.args.get("load_hf"))

    def config(self) -> transformers.PretrainedConfig:
        """The model's HF config (its vocabulary the true one)."""
        if "hf_config" not in self.metadata:
            raise CheckpointError(f"{self.path} records no HF config of its model (saved by an older version): give "
                                  "the size flags")  # fmt: skip
        return hf_config(self.metadata)


def check_same_model(saved: SavedModel, config: transformers.PretrainedConfig) -> None:
    """Refuse, in one line, a run of the model ``config`` describes when the checkpoint ``saved`` holds
    another family, depth, or count of heads or key/value heads (what a checkpoint of another model
    can share every tensor's shape with): each difference, with the flag that fits the checkpoint.
    The checkpoint's model is its recorded HF config, or (saved by an older version) its arguments."""
    recorded = saved.config() if "hf_config" in saved.metadata else None
    differences = []
    for field, arg, flag, held in _SAME:
        theirs = getattr(recorded, field, None) if recorded is not None else saved.args.get(arg)
        ours = getattr(config, field, None)
        if theirs is not None and ours is not None and theirs != ours:
            differences.append(f"holds {held.format(theirs)}, this run builds {ours}: give {flag} {theirs}")
    if differences:
        raise CheckpointError(f"{saved.path} {'; '.join(differences)}, or another --load")
