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
the vocabulary padding. Files are read with ``torch.load(weights_only=True)``.

Crash safety: an iteration is written into ``iter_XXXXXXX.tmp``; once every rank is done, every
file and directory in it is fsynced, and rank 0 commits it (:func:`commit`): ``iter_N`` (when N is
saved again) is renamed ``iter_N.old``, ``iter_N.tmp`` renamed ``iter_N``, the directory fsynced,
and only then ``latest_checkpointed_iteration.txt`` replaced (written, fsynced, renamed) and
``iter_N.old`` removed. A run killed at any point leaves ``latest`` naming a complete checkpoint:
the one before, or, killed between the two renames of a re-saved iteration, ``iter_N.old``, which
readers take while ``iter_N`` is missing (:func:`committed_dir`) and the next save puts back.

Nothing is lost: before any compute, :func:`check_save_target` refuses a ``--save`` that cannot be
written or that holds iterations the run did not load from (it would overwrite them, or move
``latest`` back past them), unless ``--overwrite-checkpoints``. Each iteration carries the
checksums of its files, verified on load, and a checkpoint with non-finite values is refused
(:mod:`~megatron_slapo.training.checkpoint_integrity`). What one rank finds wrong with a
checkpoint, every rank reports (:mod:`~megatron_slapo.parallel.agreement`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.distributed as dist

from megatron_slapo.engines.base import Engine
from megatron_slapo.errors import CheckpointError, ConfigError
from megatron_slapo.parallel.agreement import agreed_errors
from megatron_slapo.parallel.random import get_rng_tracker
from megatron_slapo.parallel.state import Layout
from megatron_slapo.training import checkpoint_integrity as integrity
from megatron_slapo.training.model import Vocabulary
from megatron_slapo.training.output_paths import check_output_dir

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
VERSION = 3.0


@dataclass
class Resume:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


def iteration_dir(base: str, iteration: int | str) -> str:
    return os.path.join(base, "release" if iteration == "release" else f"iter_{iteration:07d}")


def committed_dir(base: str, iteration: int | str) -> str:
    """The directory holding iteration ``iteration``: ``iter_N``, or ``iter_N.old`` when a run was
    killed between the two renames of re-saving N (``iter_N`` is then missing, the old copy complete)."""
    final = iteration_dir(base, iteration)
    return final + ".old" if not os.path.isdir(final) and os.path.isdir(final + ".old") else final


def _print_rank_0(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every file under ``root``, then every directory (deepest first), so that a crash after
    the renames that follow cannot leave a committed checkpoint with missing or empty files."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(os.path.join(directory, name))
        _fsync_path(directory)


def _write_file(path: str, write: Any) -> None:
    """Write ``path`` through ``write(file)`` into ``path.partial``, fsync it, and rename it into place."""
    with open(path + ".partial", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)


def _restore_interrupted(save_dir: str, iteration: int) -> None:
    """Undo a save of ``iteration`` killed between its two renames: put ``iter_N.old`` back."""
    final = iteration_dir(save_dir, iteration)
    if not os.path.isdir(final) and os.path.isdir(final + ".old"):
        os.replace(final + ".old", final)
        _fsync_path(save_dir)


def commit(save_dir: str, iteration: int) -> None:
    """Rank 0, once every rank has written its files into ``iter_N.tmp`` (and their checksums):
    sync them, make the directory iteration N and point ``latest_checkpointed_iteration.txt`` at
    it, in the order the module docstring explains."""
    final = iteration_dir(save_dir, iteration)
    tmp, old = final + ".tmp", final + ".old"
    _fsync_tree(tmp)  # the engines' own files too (ZeRO, FSDP, distributed optimizer)
    _restore_interrupted(save_dir, iteration)
    if os.path.isdir(final):  # re-saving an iteration: keep the old copy until the new one is in place
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a save killed after its last rename
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(save_dir)  # both renames are on disk before latest names the iteration
    _write_file(os.path.join(save_dir, LATEST), lambda f: f.write(str(iteration).encode()))
    _fsync_path(save_dir)
    shutil.rmtree(old, ignore_errors=True)


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


def export_metadata(tensors: dict[str, torch.Tensor], model_class: str, task: str, config: Any,
                    vocab: Vocabulary | None, vocab_params: list[str], tensor_parallel_size: int) -> dict:  # fmt: skip
    """What ``tools/convert_checkpoint.py`` needs to rebuild the HF model (class ``model_class``, of
    ``pretrain_<task>.py``) from the shards; ``tensors`` are this rank's (``state_dict(keep_vars=True)``),
    whose shard layout it records; ``vocab`` (None for an image model) tells export which rows of
    ``vocab_params`` are padding."""
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
    }


def save(
    engine: Engine, args: argparse.Namespace, layout: Layout, resume: Resume, metadata: dict, recorded: dict[str, Any]
) -> str:  # fmt: skip
    """Write iteration ``resume.iteration`` to ``args.save`` crash-safely (see the module docstring);
    return its directory. ``recorded``: the arguments as the run used them, Megatron's ``args``
    entry (``tools/convert_checkpoint.py`` rebuilds the tokenizer from it). Collective: every rank calls it."""
    final = iteration_dir(args.save, resume.iteration)
    tmp = final + ".tmp"
    _print_rank_0(f"saving checkpoint at iteration {resume.iteration:7d} to {args.save}")
    if dist.get_rank() == 0:
        _restore_interrupted(args.save, resume.iteration)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    rng = None
    if not getattr(args, "no_save_rng", False):
        rng = [None] * dist.get_world_size(layout.dp_group)
        dist.all_gather_object(rng, _rng_state(), group=layout.dp_group)
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
        _write_file(path, lambda f: torch.save(state, f))
    dist.barrier()
    shares: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, integrity.checksum_share(tmp))  # each rank hashes a share of the files
    if dist.get_rank() == 0:
        integrity.write_checksums(tmp, {name: digest for share in shares if share for name, digest in share.items()})
        commit(args.save, resume.iteration)
    dist.barrier()
    _print_rank_0(f"  successfully saved checkpoint at iteration {resume.iteration:7d} to {args.save}")
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


def saved_iterations(save_dir: str) -> list[int]:
    """The committed iterations in ``save_dir`` (``iter_N``, or ``iter_N.old`` standing in for a missing ``iter_N``)."""
    names = os.listdir(save_dir) if os.path.isdir(save_dir) else []
    found = (re.fullmatch(r"iter_(\d{7})(\.old)?", name) for name in names)
    return sorted({int(match.group(1)) for match in found if match and os.path.isdir(os.path.join(save_dir, match[0]))})


def check_save_target(args: argparse.Namespace, resume_path: str | None) -> None:
    """Refuse, before any compute, a ``--save`` this run cannot write, or one holding iterations it
    would overwrite (or leave behind ``latest``) without having loaded them: a run resuming
    (``--load`` the same directory, no ``--finetune``) continues that history; any other start
    needs ``--overwrite-checkpoints`` there. ``resume_path``: the file the run will load, if any."""
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


def checkpoint_file(load_dir: str, layout: Layout) -> str | None:
    """This rank's file of the latest checkpoint (checked to exist), or None when there is none."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        return None
    root = committed_dir(load_dir, iteration)
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


def _check(state: dict[str, Any], args: argparse.Namespace, layout: Layout, path: str, num_layers: int,
           load_optimizer: bool) -> None:  # fmt: skip
    """Refuse a checkpoint file that this run cannot load as asked, before anything is loaded."""
    saved_tp = state.get("slapo", {}).get("tensor_parallel_size")
    if saved_tp not in (None, layout.tp_size):
        raise CheckpointError(f"{path} was saved with tensor-parallel size {saved_tp}, this run uses {layout.tp_size}. "
                              f"{reshard_hint(args.load)}")  # fmt: skip
    integrity.check_finite(state, path, with_optimizer=load_optimizer)
    saved_layers = json.loads(state["args"]).get("num_layers") if isinstance(state.get("args"), str) else None
    if saved_layers not in (None, num_layers):
        raise CheckpointError(f"{path} holds a model of {saved_layers} layers, this run builds {num_layers}: give "
                              f"--num-layers {saved_layers}, or another --load")  # fmt: skip
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


def read_checked(args: argparse.Namespace, layout: Layout, path: str | None, num_layers: int) -> dict[str, Any] | None:
    """This rank's checkpoint file ``path`` (None: nothing to read), verified against its checksums
    and checked to fit this run (``num_layers``: its model depth) and its flags, before anything is
    built; the iteration's other files (the engines') are verified too, shared out among the ranks.
    Collective: every rank calls it, and a problem any rank finds is raised on every rank."""
    with agreed_errors(CheckpointError):
        if path is None:
            return None
        state = read(path)
        root = os.path.dirname(os.path.dirname(path))
        own = {os.path.join(d, FILENAME) for d in os.listdir(root) if d.startswith("mp_rank_")}
        integrity.verify_share(root, skip=own)  # each rank verifies the mp_rank file it reads
        _check(state, args, layout, path, num_layers, load_optimizer=not (args.finetune or args.no_load_optim))
        return state


def load(engine: Engine, args: argparse.Namespace, layout: Layout, path: str, state: dict[str, Any]) -> Resume:
    """Restore ``state``, this rank's checkpoint file ``path`` as :func:`read_checked` returned it,
    into ``engine`` (honouring --finetune / --no-load-optim / --no-load-rng). Collective: every rank
    calls it; an error the engine raises on any rank is raised on every rank."""
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
        _set_rng_state(state["rng_state"][layout.dp_rank])
    return Resume(state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"])
