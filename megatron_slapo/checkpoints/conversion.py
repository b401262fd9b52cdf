"""A checkpoint of either format read back as the HF model it holds (``tools/convert_checkpoint.py``).

A ``torch`` checkpoint (Megatron's legacy ``mp_rank_XX`` files) holds each tensor-parallel rank's
shards: they are read and merged here, in one process, through the shard layout each file
records. A ``torch_dist`` checkpoint holds every tensor whole already, under ``model.<HF name>``:
its ``model.*`` tensors are read with torch.distributed.checkpoint in this one process, without a
process group (no torchrun needed to export one). Either way the result is the global tensors by
HF name, a vocabulary with the padding rows of the run that saved it (they train, as Megatron's):
:func:`hf_model` builds the HF model from them, without the padding for export.

Writing goes through :mod:`~megatron_slapo.checkpoints.checkpointing` like a training run's save,
with :class:`WeightsOnly` standing in for the engine: a converted checkpoint holds weights only.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import transformers
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_slapo.checkpoints import checkpoint_integrity as integrity
from megatron_slapo.checkpoints import checkpointing, dist_checkpoint
from megatron_slapo.checkpoints.checkpoint_files import (
    LATEST,
    Resume,
    committed_dir,
    latest_iteration,
    saved_iterations,
)
from megatron_slapo.checkpoints.saved_model import hf_config
from megatron_slapo.engines.sharded_state import EngineState, Fill, whole
from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.models import MODEL_CLASSES
from megatron_slapo.models.vocabulary import tied_weights
from megatron_slapo.parallel.layout import as_stride, unshard

WEIGHTS_PREFIX = "model."  # a torch_dist checkpoint's weights; optimizer.* holds the moments


@dataclass
class Source:
    """One iteration of a checkpoint: ``root`` its directory, ``format`` ``torch`` or ``torch_dist``,
    ``common`` what the saving run recorded besides the tensors (``slapo``: the export metadata,
    ``args``: its arguments as JSON, the iteration and consumed samples), ``weights`` the global
    tensors by HF name, vocabulary padding included (a ``torch_dist`` checkpoint's only when asked)."""

    root: str
    format: str
    common: dict[str, Any]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.common["slapo"]

    @property
    def iteration(self) -> int | str:
        return self.common.get("iteration", 0)

    def recorded_args(self) -> dict[str, Any]:
        """The saving run's arguments (Megatron's ``args`` entry)."""
        return json.loads(self.common["args"]) if isinstance(self.common.get("args"), str) else {}

    def resume(self) -> Resume:
        """Where the saving run stood: its iteration and the samples it had consumed."""
        c = self.common
        iteration = c.get("iteration", 0)
        return Resume(iteration if isinstance(iteration, int) else 0, c.get("consumed_train_samples", 0),
                      c.get("consumed_valid_samples", 0))  # fmt: skip


def iteration_root(load_dir: str, iteration: int | None) -> str:
    """The directory of iteration ``iteration`` (default: the latest) of the checkpoint ``load_dir``."""
    if not os.path.isdir(load_dir):
        what = "is a file" if os.path.exists(load_dir) else "does not exist"
        raise ConfigError(f"--load {load_dir} {what}: give a checkpoint directory (a training run's --save)")
    if iteration is None:
        iteration = latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"--load {load_dir} holds no checkpoint (no {LATEST}): give a training run's "
                                  "--save directory")  # fmt: skip
    root = committed_dir(load_dir, iteration)
    if not os.path.isdir(root):
        held = ", ".join(map(str, saved_iterations(load_dir))) or "none"
        raise CheckpointError(f"{root} does not exist: --load {load_dir} holds iterations {held}")
    return root


def read(load_dir: str, iteration: int | None, with_weights: bool = True) -> Source:
    """Iteration ``iteration`` (default: the latest) of the checkpoint in ``load_dir``, of either
    format, the files read verified against their checksums. ``with_weights=False``: of a
    ``torch_dist`` checkpoint only ``common.pt`` (a ``torch`` one's weights come in the same files)."""
    root = iteration_root(load_dir, iteration)
    if not dist_checkpoint.is_dist_checkpoint(root):
        return _read_legacy(root)
    source = Source(root, "torch_dist", dist_checkpoint.read_common(root))
    if with_weights:
        recorded = integrity.recorded_checksums(root)
        integrity.verify(root, sorted(recorded or ()), recorded)  # a missing or truncated file, named
        source.weights = _read_dist_weights(root)
    return source


def _read_dist_weights(root: str) -> dict[str, torch.Tensor]:
    """The ``model.*`` tensors of the ``torch_dist`` checkpoint ``root``, whole, by HF name: read
    by torch.distributed.checkpoint in this process alone (``no_dist``), whatever layout wrote them."""
    reader = dcp.FileSystemReader(root)
    try:
        saved = reader.read_metadata().state_dict_metadata
        weights = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in saved.items()
                   if key.startswith(WEIGHTS_PREFIX) and isinstance(meta, TensorStorageMetadata)}  # fmt: skip
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(weights, storage_reader=reader, no_dist=True)
    except Exception as e:  # a file missing or truncated in a checkpoint saved without checksums
        why = " ".join(str(e).split())[:200]
        raise CheckpointError(f"cannot read checkpoint {root}: {type(e).__name__}: {why}") from e
    return {key.removeprefix(WEIGHTS_PREFIX): t for key, t in weights.items()}


def _read_legacy(root: str) -> Source:
    """A ``torch`` checkpoint's every TP rank's files (the files of its pipeline stages merged),
    its shards reassembled."""
    by_tp: dict[int, list[str]] = {}
    for d in sorted(os.listdir(root)):
        match = re.fullmatch(r"mp_rank_(\d\d)(_\d\d\d)?", d)
        if match:
            by_tp.setdefault(int(match.group(1)), []).append(d)
    if not by_tp:
        raise CheckpointError(f"{root} holds no mp_rank_XX directories (nor a torch_dist checkpoint)")
    states = [_merge_stages([checkpointing.read(os.path.join(root, d, checkpointing.FILENAME)) for d in dirs])
              for _, dirs in sorted(by_tp.items())]  # fmt: skip
    expected = states[0]["slapo"]["tensor_parallel_size"]
    if len(states) != expected:
        raise CheckpointError(f"{root} has {len(states)} TP ranks, its metadata says {expected}")
    common = {k: v for k, v in states[0].items() if k in ("iteration", "args", "slapo", "consumed_train_samples",
                                                          "consumed_valid_samples", "engine")}  # fmt: skip
    return Source(root, "torch", common, _unsharded(states))


def _merge_stages(stages: list[dict]) -> dict:
    """One TP rank's pipeline-stage files as one: their weights and shard layouts together."""
    merged = dict(stages[0])
    merged["model"] = {k: v for s in stages for k, v in s["model"].items()}
    merged["slapo"] = {**stages[0]["slapo"], "shards": {k: v for s in stages for k, v in s["slapo"]["shards"].items()}}
    return merged


def _unsharded(states: list[dict]) -> dict[str, torch.Tensor]:
    """Every TP rank's shards reassembled into the global tensors."""
    shards = states[0]["slapo"]["shards"]
    out = {}
    for name, tensor in states[0]["model"].items():
        if name in shards:
            dim, stride = shards[name]  # a tuple stride may have been stored as a list
            tensor = unshard([s["model"][name] for s in states], dim, as_stride(stride))
        out[name] = tensor.contiguous()
    return out


def model_class(metadata: dict[str, Any]) -> type[nn.Module]:
    """The class of the saved model: a transformers class, or one of ours (:mod:`megatron_slapo.models`)."""
    name = metadata["model_class"]
    return getattr(transformers, name, None) or MODEL_CLASSES[name]


def hf_model(source: Source, padded: bool = False) -> nn.Module:
    """The HF model holding ``source``'s weights, built on the meta device and given the tensors as
    they are (no copy), tied weights tied; its vocabulary without the padding rows (as HF has it),
    or with ``padded`` the rows of the run that saved it."""
    weights, vocab, rows = source.weights, source.metadata["vocab"], None
    if vocab["true"] is not None:  # image models have no vocabulary
        rows = vocab["padded"] if padded else vocab["true"]
        weights = {name: t[:rows] if name in vocab["params"] else t for name, t in weights.items()}
    with torch.device("meta"):
        model = model_class(source.metadata)(hf_config(source.metadata, rows))
    cls = type(model).__name__
    try:
        missing, unexpected = model.load_state_dict(weights, assign=True, strict=False)
    except RuntimeError as e:  # a tensor of another shape than the config gives it
        raise CheckpointError(f"{source.root} does not fit the {cls} it records: {str(e)[:300]}") from e
    untied = sorted(set(missing) - set(tied_weights(model)))
    if untied:
        raise CheckpointError(f"{source.root} lacks {untied[0]}, a weight of the {cls} it was saved from: it is "
                              "incomplete")  # fmt: skip
    if unexpected:
        raise CheckpointError(f"{source.root} holds {sorted(unexpected)[0]}, which the {cls} it was saved from does "
                              "not have: it was written by another version")  # fmt: skip
    model.tie_weights()
    return model


class WeightsOnly:
    """The part of the engine interface that writing and reading a weights-only checkpoint needs
    (a model without an optimizer): ``state_dict`` for the ``torch`` format, ``sharded_state`` and
    ``load_sharded_state`` for ``torch_dist`` (each parameter as this rank holds it, whole or its
    tensor-parallel shard)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self, directory: str, include_optimizer: bool = True) -> dict:
        return {"model": self.model.state_dict()}

    def sharded_state(self, include_optimizer: bool = True) -> EngineState:
        return whole(self.model, None)

    def load_sharded_state(self, fill: Fill, load_optimizer: bool = True) -> None:
        fill(whole(self.model, None))  # written in place into the parameters and buffers
