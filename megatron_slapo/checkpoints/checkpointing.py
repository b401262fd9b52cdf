"""Checkpoints in Megatron-LM's two formats, written atomically, resumable exactly.

``--ckpt-format torch_dist`` (the default) is :mod:`~megatron_slapo.checkpoints.dist_checkpoint`:
every tensor once, by its global identity, loadable at any layout and on any engine. This module
dispatches to it and holds the ``torch`` format (Megatron-LM's legacy layout)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/mp_rank_00/model_optim_rng.pt        (one file per TP rank; _PPP with PP)

Each file holds this TP rank's whole model shards, whatever the engine (with PP, those of its
pipeline stages; a run with PP also loads the weights of a checkpoint saved without), the
optimizer, LR scheduler and loss-scaler state (engines that partition the optimizer across
data-parallel ranks, ZeRO and FSDP, write that into their own files in the iteration directory and
keep a pointer here), the RNG states of every data-parallel rank, the iteration and the consumed
samples (the data position), plus what export needs: each tensor's shard layout, the HF config and
the vocabulary padding. Files are read with ``torch.load(weights_only=True)``. Both formats are
committed crash-safely (:mod:`~megatron_slapo.checkpoints.checkpoint_files`).

Nothing is lost: before any compute, :func:`check_save_target` refuses a ``--save`` that cannot be
written or that holds iterations the run did not load from (it would overwrite them, or move
``latest`` back past them), unless ``--overwrite-checkpoints``. Each iteration carries the
checksums of its files, verified on load, and a checkpoint with non-finite values is refused
(:mod:`~megatron_slapo.checkpoints.checkpoint_integrity`). What one rank finds wrong with a
checkpoint, every rank reports (:mod:`~megatron_slapo.parallel.agreement`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from megatron_slapo.arguments.output_paths import check_output_dir
from megatron_slapo.checkpoints import checkpoint_integrity as integrity
from megatron_slapo.checkpoints import dist_checkpoint
from megatron_slapo.checkpoints.checkpoint_files import (
    LATEST,
    Resume,
    committed_dir,
    finish_save,
    iteration_dir,
    latest_iteration,
    saved_iterations,
    start_save,
    write_file,
)
from megatron_slapo.checkpoints.rng_state import rng_state, set_rng_state
from megatron_slapo.checkpoints.saved_model import SavedModel, check_same_model
from megatron_slapo.engines.base import Engine
from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.models.vocabulary import Vocabulary
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.state import Layout

FILENAME = "model_optim_rng.pt"
VERSION = 3.0


def export_metadata(tensors: dict[str, torch.Tensor], model_class: str, task: str, config: Any,
                    vocab: Vocabulary | None, vocab_params: list[str], tensor_parallel_size: int,
                    tied: dict[str, str] | None = None) -> dict:  # fmt: skip
    """What ``tools/convert_checkpoint.py`` needs to rebuild the HF model (class ``model_class``, of
    ``pretrain_<task>.py``) from the shards; ``tensors`` are this rank's (``state_dict(keep_vars=True)``),
    whose shard layout it records; ``vocab`` (None for an image model) tells export which rows of
    ``vocab_params`` are padding; ``tied``: HF's tied weights (name -> the name it is tied to), under
    which a ``torch_dist`` checkpoint stores them."""
    shards = {
        name: [t.partition_dim, t.partition_stride]
        for name, t in tensors.items()
        if getattr(t, "tensor_model_parallel", False)
    }
    return {
        "task": task,
        "model_class": model_class,
        "hf_config": config.to_json_string(),
        "shards": shards,
        "vocab": {
            "true": vocab.true_size if vocab else None,
            "padded": vocab.padded_size if vocab else None,
            "params": vocab_params,
        },  # fmt: skip
        "tensor_parallel_size": tensor_parallel_size,
        "tied": dict(tied or {}),
    }


def _print_rank_0(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def save(engine: Engine, args: argparse.Namespace, layout: Layout, resume: Resume, metadata: dict,
         recorded: dict[str, Any], asynchronous: dist_checkpoint.AsyncSaves | None = None) -> str:  # fmt: skip
    """Write iteration ``resume.iteration`` to ``args.save`` crash-safely in ``--ckpt-format`` (see
    the module docstring); return its directory. ``recorded``: the arguments as the run used them,
    Megatron's ``args`` entry (``tools/convert_checkpoint.py`` rebuilds the tokenizer from it);
    ``asynchronous``: where a ``torch_dist`` save goes on in the background (``--async-save``).
    Collective: every rank calls it."""
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        common = {
            "checkpoint_version": VERSION, "iteration": resume.iteration, "args": json.dumps(recorded, default=str),
            "engine": getattr(args, "engine", None), "consumed_train_samples": resume.consumed_train_samples,
            "consumed_valid_samples": resume.consumed_valid_samples, "slapo": metadata,
            "layout": dist_checkpoint.layout_record(args, dist.get_world_size()),
        }  # fmt: skip
        return dist_checkpoint.save(engine, args, layout, common, dist_checkpoint.Identity.of(metadata), asynchronous)
    _print_rank_0(f"saving checkpoint at iteration {resume.iteration:7d} to {args.save}")
    tmp = start_save(args.save, resume.iteration)
    rng = None
    if not getattr(args, "no_save_rng", False):
        rng = [None] * dist.get_world_size(layout.dp_group)
        dist.all_gather_object(rng, rng_state(), group=layout.dp_group)
    state = engine.state_dict(tmp, include_optimizer=not args.no_save_optim)
    if layout.dp_rank == 0:
        state.update(
            checkpoint_version=VERSION, iteration=resume.iteration, args=json.dumps(recorded, default=str),
            engine=getattr(args, "engine", None), consumed_train_samples=resume.consumed_train_samples,
            consumed_valid_samples=resume.consumed_valid_samples, slapo=metadata,
        )  # fmt: skip
        if rng is not None:
            state["rng_state"] = rng
        path = os.path.join(tmp, layout.rank_dir(), FILENAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, lambda f: torch.save(state, f))
    dist.barrier()
    finish_save(args.save, resume.iteration, integrity.checksum_share(tmp))  # each rank hashes a share of the files
    _print_rank_0(f"  successfully saved checkpoint at iteration {resume.iteration:7d} to {args.save}")
    return iteration_dir(args.save, resume.iteration)


def check_save_target(args: argparse.Namespace, resume_path: str | None) -> None:
    """Refuse, before any compute, a ``--save`` this run cannot write, or one holding iterations it
    would overwrite (or leave behind ``latest``) without having loaded them: a run resuming
    (``--load`` the same directory, no ``--finetune``) continues that history; any other start
    needs ``--overwrite-checkpoints`` there. ``resume_path``: what the run will load, if any."""
    if not args.save:
        return
    check_output_dir("--save", args.save)
    same = bool(args.load) and os.path.realpath(args.load) == os.path.realpath(args.save)
    if getattr(args, "overwrite_checkpoints", False) or (resume_path and same and not args.finetune):
        return
    loaded = latest_iteration(args.load) if resume_path and not args.finetune else 0
    start = loaded if isinstance(loaded, int) else 0  # a release checkpoint starts at 0
    later = [n for n in saved_iterations(args.save) if n > start]
    if not later:
        return
    shown = ", ".join(map(str, later)) if len(later) <= 4 else f"{later[0]}, {later[1]}, ... {later[-1]}"
    how = f"pass --load {args.save}" + (" without --finetune" if same else "")
    raise ConfigError(
        f"--save {args.save} already holds iteration(s) {shown}, which this run (starting at iteration {start}) "
        f"would overwrite or leave behind: to continue that run {how}; otherwise give another --save, or pass "
        "--overwrite-checkpoints to write over them"
    )


def checkpoint_file(load_dir: str, layout: Layout, ckpt_format: str = "torch", auto_detect: bool = False) -> str | None:
    """What this rank loads of the latest checkpoint (checked to exist): its file of a ``torch``
    checkpoint, the iteration directory of a ``torch_dist`` one; None when there is none. A
    checkpoint of another format than ``ckpt_format`` is refused, unless ``auto_detect``."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    root = committed_dir(load_dir, iteration)
    if not os.path.isdir(root):
        raise CheckpointError(f"{os.path.join(load_dir, LATEST)} names iteration {iteration}, but {root} does not "
                              "exist: the checkpoint was deleted or only partly copied")  # fmt: skip
    found = "torch_dist" if dist_checkpoint.is_dist_checkpoint(root) else "torch"
    if found != ckpt_format and not auto_detect:
        raise CheckpointError(
            f"{root} is a checkpoint in the {found} format, this run has --ckpt-format {ckpt_format}: pass "
            f"--ckpt-format {found} (or --auto-detect-ckpt-format to load it and save in {ckpt_format}), or convert "
            f"it with tools/convert_checkpoint.py {'to-torch' if found == 'torch_dist' else 'to-torch-dist'}"
        )
    if found == "torch_dist":
        return root
    path = os.path.join(root, layout.rank_dir(), FILENAME)
    whole = os.path.join(root, f"mp_rank_{layout.tp_rank:02d}", FILENAME)
    if not os.path.isfile(path) and layout.pp_size > 1 and os.path.isfile(whole):
        return whole  # saved without pipeline parallelism: every stage takes its weights from the whole model
    if not os.path.isfile(path):
        saved = sorted(d for d in os.listdir(root) if d.startswith("mp_rank_"))
        if layout.rank_dir() in saved or not saved:
            raise CheckpointError(f"checkpoint {path} is missing: the checkpoint in {root} is incomplete")
        raise CheckpointError(
            f"{root} holds {', '.join(saved)}: it was written with another tensor/pipeline-parallel size than this "
            f"run's ({layout.rank_dir()} of TP {layout.tp_size} x PP {layout.pp_size}). {reshard_hint(load_dir)}"
        )
    return path


def describe_load(load_dir: str, args: argparse.Namespace, world: int) -> str | None:
    """What ``--load`` holds and how a run of ``world`` ranks with ``args`` would load it (for
    ``tools/explain.py``): None when there is no checkpoint there yet."""
    iteration = latest_iteration(load_dir)
    root = committed_dir(load_dir, iteration) if iteration is not None else None
    if root is None or not os.path.isdir(root):
        return None
    if not dist_checkpoint.is_dist_checkpoint(root):
        return (f"{root} (torch format): loads only at the tensor- and pipeline-parallel sizes that saved it; "
                "--ckpt-format torch_dist checkpoints load at any layout")  # fmt: skip
    saved = dist_checkpoint.read_common(root).get("layout", {})
    here = dist_checkpoint.layout_record(args, world)
    return f"{root} (torch_dist): {dist_checkpoint.resharding(saved, here)}" if saved else f"{root} (torch_dist)"


def read_saved_model(load_dir: str) -> SavedModel | None:
    """What the latest checkpoint in ``load_dir`` records of its model, its tensors unread (a
    ``torch`` checkpoint's: those of its first rank file); None when there is none yet."""
    iteration = latest_iteration(load_dir)
    root = committed_dir(load_dir, iteration) if iteration is not None else None
    if root is None or not os.path.isdir(root):
        return None  # the run's own checks say what is missing
    if dist_checkpoint.is_dist_checkpoint(root):
        return SavedModel.of(root, dist_checkpoint.read_common(root))
    ranks = sorted(d for d in os.listdir(root) if d.startswith("mp_rank_"))
    path = os.path.join(root, ranks[0], FILENAME) if ranks else None
    if path is None or not os.path.isfile(path):
        return None
    try:  # the record alone: the weights stay on disk (mapped, not read), and loading verifies the file
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        state = read(path)  # verified first: says what is wrong with the file
    return SavedModel.of(path, state)


def check_loadable(load_dir: str, model: PretrainedConfig, shapes: dict[str, tuple[int, ...]],
                   names: dict[str, Any]) -> None:  # fmt: skip
    """Refuse, as a run loading it would, the checkpoint in ``load_dir`` when it holds another model
    than the one whose HF config is ``model`` and whose global tensor ``shapes`` these are (by HF
    name; ``names``: its tied weights and vocabulary tensors, as :func:`export_metadata` records
    them): for ``tools/explain.py``, which plans the run without loading anything."""
    saved = read_saved_model(load_dir)
    if saved is None:
        return
    check_same_model(saved, model)
    if os.path.isdir(saved.path):  # a torch_dist checkpoint (a torch one loads at the layout that saved it only)
        dist_checkpoint.check_model_shapes(saved.path, shapes, names)


def reshard_hint(load_dir: str) -> str:
    """How to load a legacy (``torch``) checkpoint at another layout."""
    return (
        f"To reshard it: resume it once at its own layout with --auto-detect-ckpt-format (it then saves in "
        f"--ckpt-format torch_dist, optimizer included), or convert its weights with tools/convert_checkpoint.py "
        f"to-torch-dist --load {load_dir} --save NEW_DIR and resume with --load NEW_DIR --no-load-optim --no-load-rng; "
        "a torch_dist checkpoint loads at any layout"
    )


def read(path: str, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Load one checkpoint file safely (weights only), once its checksum is verified."""
    integrity.verify_file(path)
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}") from e


def _saved_without_pipeline(path: str, layout: Layout) -> bool:
    """Whether this rank's checkpoint file is another layout's (``checkpoint_file`` falls back to
    the file of a checkpoint saved without pipeline parallelism)."""
    return os.path.basename(os.path.dirname(path)) != layout.rank_dir()


def _check(state: dict[str, Any], args: argparse.Namespace, layout: Layout, path: str, model: PretrainedConfig,
           load_optimizer: bool) -> None:  # fmt: skip
    """Refuse a checkpoint file that this run (of the model whose HF config is ``model``) cannot load
    as asked, before anything is loaded."""
    saved_tp = state.get("slapo", {}).get("tensor_parallel_size")
    if saved_tp not in (None, layout.tp_size):
        raise CheckpointError(f"{path} was saved with tensor-parallel size {saved_tp}, this run uses {layout.tp_size}. "
                              f"{reshard_hint(args.load)}")  # fmt: skip
    integrity.check_finite(state, path, with_optimizer=load_optimizer)
    check_same_model(SavedModel.of(path, state), model)
    other_layout = _saved_without_pipeline(path, layout)
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
    if args.finetune or state.get("iteration", 0) == 0 or other_layout or args.no_load_rng:
        return  # no RNG state to restore
    if "rng_state" not in state:
        raise CheckpointError(f"{path} holds no RNG state (saved with --no-save-rng); pass --no-load-rng "
                              "(or --finetune) to resume without it")  # fmt: skip
    if layout.dp_rank >= len(state["rng_state"]):
        raise CheckpointError(f"{path} holds RNG states for {len(state['rng_state'])} data-parallel ranks; pass "
                              "--no-load-rng")  # fmt: skip


def read_checked(args: argparse.Namespace, layout: Layout, path: str | None,
                 model: PretrainedConfig) -> dict[str, Any] | None:  # fmt: skip
    """This rank's checkpoint file ``path`` (None: nothing to read; a ``torch_dist`` iteration
    directory: its common state, see :func:`dist_checkpoint.read_checked`), verified against its checksums
    and checked to fit this run (``model``: its HF config, :func:`check_same_model`) and its flags, before
    anything is built; the iteration's other files (the engines') are verified too, shared out among the ranks.
    Collective: every rank calls it, and a problem any rank finds is raised on every rank."""
    with agreed_errors(CheckpointError):
        if path is None:
            return None
        if os.path.isdir(path):  # a torch_dist checkpoint: what every rank reads is its common state
            return dist_checkpoint.read_checked(args, path, model)
        state = read(path)
        root = os.path.dirname(os.path.dirname(path))
        own = {os.path.join(d, FILENAME) for d in os.listdir(root) if d.startswith("mp_rank_")}
        integrity.verify_share(root, skip=own)  # each rank verifies the mp_rank file it reads
        _check(state, args, layout, path, model, load_optimizer=not (args.finetune or args.no_load_optim))
        return state


def load(engine: Engine, args: argparse.Namespace, layout: Layout, path: str, state: dict[str, Any],
         metadata: dict[str, Any] | None = None) -> Resume:  # fmt: skip
    """Restore ``state``, this rank's checkpoint file ``path`` as :func:`read_checked` returned it,
    into ``engine`` (honouring --finetune / --no-load-optim / --no-load-rng); a ``torch_dist``
    checkpoint (``path`` its directory) needs the run's ``metadata`` (how its tensors are named).
    Collective: every rank calls it; an error the engine raises on any rank is raised on every rank."""
    if os.path.isdir(path):
        return dist_checkpoint.resume(engine, args, layout, path, state, metadata or {})
    load_optimizer = not (args.finetune or args.no_load_optim)
    if load_optimizer and "optimizer" not in state and state.get("iteration", 0) > 0 and dist.get_rank() == 0:
        print(f" > WARNING: {path} has no optimizer state (saved with --no-save-optim): the optimizer and the LR "
              "schedule start afresh", flush=True)  # fmt: skip
    with agreed_errors(CheckpointError):
        try:
            engine.load_state_dict(state, os.path.dirname(os.path.dirname(path)), load_optimizer=load_optimizer)
        except RuntimeError as e:  # shape or key mismatch
            raise CheckpointError(f"{path} does not fit this model: {str(e)[:300]}") from e
    if args.finetune or state.get("iteration", 0) == 0:
        return Resume()  # a release or from-hf checkpoint: weights only, training starts at 0
    if _saved_without_pipeline(path, layout):  # one stage's RNG states: every stage keeps its own seeding
        if dist.get_rank() == 0:
            print(f" > WARNING: {path} was saved without pipeline parallelism: RNG states not restored", flush=True)
    elif not args.no_load_rng:
        set_rng_state(state["rng_state"][layout.dp_rank])
    return Resume(state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"])
