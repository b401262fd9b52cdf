"""A model's vocabulary rows: Megatron pads the tokenizer's vocabulary to a multiple of
``--make-vocab-size-divisible-by`` x the TP size so that it shards evenly, and records the true
size so that export can drop the padding. The trainer and ``tools/convert_checkpoint.py`` pad
through the same functions here, so a converted checkpoint has the rows a run
would give it. Also which parameters hold vocabulary rows and which weights HF ties.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

import transformers
from torch import nn


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron's padding: the next multiple of ``divisible_by * tensor_parallel``."""
    multiple = divisible_by * tensor_parallel
    return int(math.ceil(vocab_size / multiple) * multiple)


def hf_vocab_size(model_vocab: int, tokenizer_vocab: int, divisible_by: int, tensor_parallel: int) -> int:
    """Embedding rows of a model that starts from an HF config: the model's own rows if they cover
    the tokenizer's padded vocabulary and split evenly across TP, else Megatron's padding of them."""
    size = max(model_vocab, padded_vocab_size(tokenizer_vocab, divisible_by, tensor_parallel))
    return size if size % tensor_parallel == 0 else padded_vocab_size(size, divisible_by, tensor_parallel)


@dataclass(frozen=True)
class Vocabulary:
    """The vocabulary's two sizes: the ids export keeps (``true_size``) and the embedding rows the
    model trains with, padded so that they shard evenly (``padded_size``)."""

    true_size: int
    padded_size: int


def vocabulary(
    args: argparse.Namespace, tokenizer: Any, hf_config: transformers.PretrainedConfig | None = None
) -> Vocabulary:
    """The run's vocabulary: the tokenizer's, padded Megatron's way; with an HF config (``--hf-config``,
    ``--load-hf``), the model's own rows where they are more (see :func:`hf_vocab_size`)."""
    tp, multiple = args.tensor_model_parallel_size, args.make_vocab_size_divisible_by
    if hf_config is None:
        return Vocabulary(tokenizer.vocab_size, padded_vocab_size(tokenizer.vocab_size, multiple, tp))
    return Vocabulary(max(hf_config.vocab_size, tokenizer.vocab_size),  # export keeps the model's rows
                      hf_vocab_size(hf_config.vocab_size, tokenizer.vocab_size, multiple, tp))  # fmt: skip


def vocab_parameter_names(model: nn.Module) -> list[str]:
    """Names (ties included) of the tensors with one row per vocabulary entry: embedding, LM head, its
    bias (none for an image model)."""
    if model.main_input_name == "pixel_values":
        return []
    out = model.get_output_embeddings()
    vocab_tensors = [model.get_input_embeddings().weight, getattr(out, "weight", None), getattr(out, "bias", None)]
    ids = {id(t) for t in vocab_tensors if t is not None}
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids)


def tied_weights(model: nn.Module) -> dict[str, str]:
    """HF's tied weights of ``model`` as built (name -> the name it is tied to; none when the
    config unties them)."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})
