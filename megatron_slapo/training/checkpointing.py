"""Megatron-layout checkpoints, written atomically, resumable exactly.

Layout (Megatron-LM's legacy format)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/mp_rank_00/model_optim_rng.pt        (one file per TP rank; _PPP with PP)

Each file holds this TP rank's whole model shards, whatever the engine (with PP, those of its
pipeline stages; a run with PP also loads the weights of a checkpoint saved without), the
optimizer, LR scheduler and loss-scaler state (engines that partition the optimizer across
data-parallel ranks, ZeRO and FSDP, write that into their own files in the iteration directory and
keep a pointer here), the RNG states of every data-parallel rank, the iteration and the consumed
samples (the data position), plus what export needs: each tensor's shard layout, the HF config and
the vocabulary padding. An iteration is written into ``iter_XXXXXXX.tmp`` and renamed when every rank is done;
``latest_checkpointed_iteration.txt`` is replaced only after that, so a run killed mid-save
resumes from the previous checkpoint. Files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron_slapo.engines.base import Engine
from megatron_slapo.errors import CheckpointError
from megatron_slapo.parallel.random import get_rng_tracker

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
VERSION = 3.0


@dataclass
class Layout:
    """Where this rank sits: its TP/PP/DP coordinates decide its file and whether it writes."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_group: dist.ProcessGroup | None

    @classmethod
    def current(cls) -> Layout:
        """This process's coordinates, from megatron-core's parallel_state."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(), dp_group=ps.get_data_parallel_group(),
        )  # fmt: skip

    def rank_dir(self) -> str:
        return f"mp_rank_{self.tp_rank:02d}" + (f"_{self.pp_rank:03d}" if self.pp_size > 1 else "")


@dataclass
class Resume:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def iteration_dir(base: str, iteration: int | str) -> str:
    return os.path.join(base, "release" if iteration == "release" else f"iter_{iteration:07d}")


def _rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = numpy.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tracker": get_rng_tracker().get_states(),
    }  # fmt: skip


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np = state["numpy"]
    numpy.random.set_state(
        (np["name"], np["keys"].numpy().astype(numpy.uint32), np["pos"], np["has_gauss"], np["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


def export_metadata(tensors: dict[str, torch.Tensor], model_class: str, args: argparse.Namespace, config: Any,
                    vocab_params: list[str]) -> dict:  # fmt: skip
    """What ``tools/convert_checkpoint.py`` needs to rebuild the HF model (class ``model_class``) from
    the shards; ``tensors`` are this rank's (``state_dict(keep_vars=True)``), whose shard layout it records."""
    shards = {
        name: [t.partition_dim, t.partition_stride]
        for name, t in tensors.items()
        if getattr(t, "tensor_model_parallel", False)
    }
    return {
        "task": args.task,
        "model_class": model_class,
        "hf_config": config.to_json_string(),
        "shards": shards,
        "vocab": {"true": args.true_vocab_size, "padded": args.padded_vocab_size, "params": vocab_params},
        "tensor_parallel_size": args.tensor_model_parallel_size,
    }


def save(
    engine: Engine, args: argparse.Namespace, layout: Layout, resume: Resume, metadata: dict
) -> str:  # fmt: skip
    """Write iteration ``resume.iteration`` to ``args.save`` atomically; return its directory."""
    final = iteration_dir(args.save, resume.iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    rng = [None] * dist.get_world_size(layout.dp_group)
    dist.all_gather_object(rng, _rng_state(), group=layout.dp_group)
    state = engine.state_dict(tmp, include_optimizer=not args.no_save_optim)
    if layout.dp_rank == 0:
        state.update(
            checkpoint_version=VERSION, iteration=resume.iteration, args=json.dumps(vars(args), default=str),
            engine=getattr(args, "engine", None),
            rng_state=rng, consumed_train_samples=resume.consumed_train_samples,
            consumed_valid_samples=resume.consumed_valid_samples, slapo=metadata,
        )  # fmt: skip
        path = os.path.join(tmp, layout.rank_dir(), FILENAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path + ".partial")
        os.replace(path + ".partial", path)
    dist.barrier()
    if dist.get_rank() == 0:
        old = final + ".old"
        if os.path.isdir(final):  # re-saving an iteration: keep the old copy until the new one is in place
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        latest = os.path.join(args.save, LATEST)
        with open(latest + ".tmp", "w") as f:
            f.write(str(resume.iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest + ".tmp", latest)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest_iteration(load_dir: str) -> int | str | None:
    """The iteration named by ``latest_checkpointed_iteration.txt`` (or Megatron's ``"release"``);
    None if there is no checkpoint yet (Megatron then starts from scratch)."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found {text[:40]!r}")
    return int(text)


def checkpoint_file(load_dir: str, layout: Layout) -> str | None:
    """This rank's file of the latest checkpoint (checked to exist), or None when there is none."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    root = iteration_dir(load_dir, iteration)
    path = os.path.join(root, layout.rank_dir(), FILENAME)
    whole = os.path.join(root, f"mp_rank_{layout.tp_rank:02d}", FILENAME)
    if not os.path.isfile(path) and layout.pp_size > 1 and os.path.isfile(whole):
        return whole  # saved without pipeline parallelism: every stage takes its weights from the whole model
    if not os.path.isdir(root):
        raise CheckpointError(f"{os.path.join(load_dir, LATEST)} names iteration {iteration}, but {root} does not "
                              "exist: the checkpoint was deleted or only partly copied")  # fmt: skip
    if not os.path.isfile(path):
        saved = sorted(d for d in os.listdir(root) if d.startswith("mp_rank_"))
        if layout.rank_dir() in saved or not saved:
            raise CheckpointError(f"checkpoint {path} is missing: the checkpoint in {root} is incomplete")
        raise CheckpointError(
            f"{root} holds {', '.join(saved)}: it was written with another tensor/pipeline-parallel size than this "
            f"run's ({layout.rank_dir()} of TP {layout.tp_size} x PP {layout.pp_size}). {reshard_hint(load_dir)}"
        )
    return path


def reshard_hint(load_dir: str) -> str:
    """How to turn a checkpoint into one of another tensor-parallel size."""
    return (
        f"To reshard it: python tools/convert_checkpoint.py to-hf --load {load_dir} --save-hf HF_DIR, then "
        "torchrun --nproc_per_node TP tools/convert_checkpoint.py from-hf --load-hf HF_DIR --save NEW_DIR "
        "--schedule SCHEDULE --tensor-model-parallel-size TP, and train with --load NEW_DIR --finetune"
    )


def read(path: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Load one checkpoint file safely (weights only)."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}") from e


def load(engine: Engine, args: argparse.Namespace, layout: Layout, path: str) -> Resume:
    """Restore what ``save`` wrote (honouring --finetune / --no-load-optim / --no-load-rng)."""
    state = read(path)
    saved_tp = state.get("slapo", {}).get("tensor_parallel_size")
    if saved_tp not in (None, layout.tp_size):
        raise CheckpointError(f"{path} was saved with tensor-parallel size {saved_tp}, this run uses {layout.tp_size}. "
                              f"{reshard_hint(args.load)}")  # fmt: skip
    load_optimizer = not (args.finetune or args.no_load_optim)
    if load_optimizer and "optimizer" not in state and state.get("iteration", 0) > 0 and dist.get_rank() == 0:
        print(f" > WARNING: {path} has no optimizer state (saved with --no-save-optim): the optimizer and the LR "
              "schedule start afresh", flush=True)  # fmt: skip
    other_layout = os.path.basename(os.path.dirname(path)) != layout.rank_dir()  # saved without PP
    if load_optimizer and "optimizer" in state and other_layout:
        raise CheckpointError(
            f"{path} was saved without pipeline parallelism: its optimizer state does not fit the pipeline stages; "
            "pass --no-load-optim (or --finetune) to load only the weights"
        )
    saved_engine = state.get("engine") or "ddp"
    if load_optimizer and "optimizer" in state and saved_engine != args.engine:
        raise CheckpointError(
            f"{path} was written by --engine {saved_engine}, whose optimizer state --engine {args.engine} cannot "
            "read; pass --no-load-optim (or --finetune) to load only the weights"
        )
    try:
        engine.load_state_dict(state, os.path.dirname(os.path.dirname(path)), load_optimizer=load_optimizer)
    except RuntimeError as e:  # shape or key mismatch
        raise CheckpointError(f"{path} does not fit this model: {str(e)[:300]}") from e
    if args.finetune or state.get("iteration", 0) == 0:
        return Resume()  # a release or from-hf checkpoint: weights only, training starts at 0
    if other_layout:  # its RNG states are one stage's: every stage keeps its own seeding instead
        if dist.get_rank() == 0:
            print(f" > WARNING: {path} was saved without pipeline parallelism: RNG states not restored", flush=True)
    elif not args.no_load_rng:
        states = state["rng_state"]
        if layout.dp_rank >= len(states):
            raise CheckpointError(f"{path} holds RNG states for {len(states)} data-parallel ranks; pass --no-load-rng")
        _set_rng_state(states[layout.dp_rank])
    return Resume(state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"])
