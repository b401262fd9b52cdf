"""Checking the HF model directory of ``--hf-config`` / ``--load-hf`` before anything is built.

transformers finds out what is wrong with a directory in its own terms, or in a traceback, and
about the weights only once the process groups and the data are up: a ``config.json`` that is not
JSON is an OSError that does not say so, one with 0 attention heads divides by zero, a directory
without weights or with a truncated ``model.safetensors`` fails in ``from_pretrained``. These
checks read only the small files and the safetensors headers, and name the file and what to do.
"""

from __future__ import annotations

import json
import os

import transformers
from safetensors import SafetensorError, safe_open
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from megatron_slapo.errors import ConfigError


def _read_json(where: str, path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: {path} is not valid JSON ({e}); fix it, or write it again with "
                          "save_pretrained") from e  # fmt: skip


def check_config_json(where: str, directory: str) -> None:
    """ConfigError when ``directory/config.json`` exists but is not a JSON object."""
    path = os.path.join(directory, "config.json")
    if os.path.isfile(path) and not isinstance(_read_json(where, path), dict):
        raise ConfigError(f"{where}: {path} is not a config (a JSON object); write it again with save_pretrained")


def check_task_fits(config: transformers.PretrainedConfig, task: str, source: str) -> None:
    """pretrain_gpt.py trains next-token prediction, pretrain_bert.py masked LM: refuse a model that
    cannot do it (an encoder for GPT, a decoder for BERT) rather than train the wrong objective."""
    kind = config.model_type
    if task == "vision":
        if type(config) not in transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
            raise ConfigError(f"{source} holds a {kind} model, which is not an image classifier: pretrain_vision.py "
                              "trains image models such as WideResNet")  # fmt: skip
    elif task == "t5":
        if type(config) not in transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING or config.model_type != "t5":
            raise ConfigError(f"{source} holds a {kind} model: pretrain_t5.py trains T5 (--model-type t5)")
    elif task == "gpt":
        causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING and not config.is_encoder_decoder
        # Encoder families that HF can also run as decoders carry `is_decoder` (False unless set).
        if not causal or not getattr(config, "is_decoder", True):
            raise ConfigError(f"{source} holds a {kind} model, which is not a causal LM: pretrain_gpt.py trains "
                              "decoder-only models (for an encoder such as BERT use pretrain_bert.py)")  # fmt: skip
    elif type(config) not in transformers.MODEL_FOR_MASKED_LM_MAPPING or getattr(config, "is_decoder", False):
        raise ConfigError(f"{source} holds a {kind} model, which is not a masked LM: pretrain_bert.py trains "
                          "encoders such as BERT, RoBERTa, ALBERT (for a causal LM use pretrain_gpt.py)")  # fmt: skip


def check_shape(config: transformers.PretrainedConfig, source: str) -> None:
    """ConfigError when the model cannot be built from the config: no layers or heads, a width
    its heads do not split (unless the config sets the heads' width itself), key/value heads that
    do not divide the heads. Each is named by its field in ``config.json``."""

    def field(name: str) -> str:  # e.g. GPT-2 names its heads n_head
        return config.attribute_map.get(name, name)

    sizes = {name: getattr(config, name, None) for name in
             ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")}  # fmt: skip
    for name, size in sizes.items():
        if isinstance(size, int) and size < 1:
            raise ConfigError(
                f"{source}: config.json has {field(name)} {size}: a model needs at least 1; fix the config"
            )
    heads, kv, width = sizes["num_attention_heads"], sizes["num_key_value_heads"], sizes["hidden_size"]
    if not (isinstance(heads, int) and isinstance(width, int)):
        return  # not a transformer's attention (an image model)
    own_width = getattr(config, "head_dim", None) or getattr(config, "d_kv", None)  # T5, or a width set apart
    if width % heads and not own_width:
        raise ConfigError(
            f"{source}: config.json's {field('hidden_size')} {width} is not divisible by its "
            f"{field('num_attention_heads')} {heads}: each head takes an equal slice of the width"
        )
    if isinstance(kv, int) and heads % kv:
        raise ConfigError(f"{source}: config.json's {field('num_key_value_heads')} {kv} does not divide its "
                          f"{field('num_attention_heads')} {heads}: each key/value head serves the same number of "
                          "heads")  # fmt: skip


def _shards(where: str, directory: str, index: str) -> list[str]:
    weight_map = _read_json(where, os.path.join(directory, index))
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{where}: {index} lists no weights (no weight_map); write the model again with "
                          "save_pretrained")  # fmt: skip
    shards = [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    missing = [os.path.basename(path) for path in shards if not os.path.isfile(path)]
    if missing:
        raise ConfigError(f"{where}: {index} names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                          "missing: copy the whole directory")  # fmt: skip
    return shards


def check_weights(where: str, directory: str) -> None:
    """ConfigError unless ``directory`` holds weights ``from_pretrained`` can read: safetensors
    (one file, or the shards its index lists) whose headers read whole, or PyTorch ``.bin`` files
    (only their presence is checked)."""
    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        if os.path.isfile(os.path.join(directory, single)):
            files = [os.path.join(directory, single)]
        elif os.path.isfile(os.path.join(directory, index)):
            files = _shards(where, directory, index)
        else:
            continue
        for path in files:
            if path.endswith(".safetensors"):
                try:
                    with safe_open(path, framework="pt") as f:
                        f.keys()
                except (SafetensorError, OSError) as e:
                    raise ConfigError(f"{where}: {path} cannot be read ({e}): truncated or corrupt? copy or write "
                                      "it again") from e  # fmt: skip
        return
    raise ConfigError(f"{where} has a config.json but no weights ({SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME}): give a "
                      f"directory written by save_pretrained (or, to train that model from random weights, --hf-config "
                      f"{directory} instead)")  # fmt: skip
