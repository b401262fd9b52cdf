"""The files of a checkpoint directory, whatever the format: iteration directories, the tracker
(``latest_checkpointed_iteration.txt``) and the crash-safe commit that moves it.

An iteration is written into ``iter_XXXXXXX.tmp``; once every rank is done, every file and
directory in it is fsynced, and rank 0 commits it (:func:`commit`): ``iter_N`` (when N is saved
again) is renamed ``iter_N.old``, ``iter_N.tmp`` renamed ``iter_N``, the directory fsynced, and
only then ``latest_checkpointed_iteration.txt`` replaced (written, fsynced, renamed) and
``iter_N.old`` removed. A run killed at any point leaves ``latest`` naming a complete checkpoint:
the one before, or, killed between the two renames of a re-saved iteration, ``iter_N.old``, which
readers take while ``iter_N`` is missing (:func:`committed_dir`) and the next save puts back.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_slapo.checkpoints import checkpoint_integrity as integrity
from megatron_slapo.errors import CheckpointError

LATEST = "latest_checkpointed_iteration.txt"


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


def write_file(path: str, write: Any) -> None:
    """Write ``path`` through ``write(file)`` into ``path.partial``, fsync it, and rename it into place."""
    with open(path + ".partial", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)


def restore_interrupted(save_dir: str, iteration: int) -> None:
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
    restore_interrupted(save_dir, iteration)
    if os.path.isdir(final):  # re-saving an iteration: keep the old copy until the new one is in place
        shutil.rmtree(old, ignore_errors=True)  # a leftover of a save killed after its last rename
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_path(save_dir)  # both renames are on disk before latest names the iteration
    write_file(os.path.join(save_dir, LATEST), lambda f: f.write(str(iteration).encode()))
    _fsync_path(save_dir)
    shutil.rmtree(old, ignore_errors=True)


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


def start_save(save_dir: str, iteration: int) -> str:
    """Rank 0 makes ``iter_N.tmp`` empty (a save of N killed between its renames put back first);
    every rank waits for it. Returns its path. Collective: every rank calls it."""
    tmp = iteration_dir(save_dir, iteration) + ".tmp"
    if dist.get_rank() == 0:
        restore_interrupted(save_dir, iteration)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    return tmp


def finish_save(save_dir: str, iteration: int, checksums: dict[str, str]) -> None:
    """Once every rank has written its files into ``iter_N.tmp``: rank 0 records all ranks'
    ``checksums`` (path relative to it -> digest) and commits the iteration. Collective."""
    shares: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, checksums)
    if dist.get_rank() == 0:
        tmp = iteration_dir(save_dir, iteration) + ".tmp"
        integrity.write_checksums(tmp, {k: v for share in shares if share for k, v in share.items()})
        commit(save_dir, iteration)
    dist.barrier()
