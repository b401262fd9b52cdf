"""Whether a checkpoint holds what was saved, and numbers training can go on from.

A flipped bit in a checkpoint file loads without complaint: every step is then NaN and skipped,
and the run saves the corrupted state as a new iteration. Two checks refuse that at load time:

- **Checksums.** Before an iteration is committed, its directory gets ``checksums.sha256``: the
  SHA-256 of every file in it (the engines' own files too; the ranks hash a share each), in
  ``sha256sum``'s format, so ``cd iter_0000100 && sha256sum -c checksums.sha256`` checks a copy by
  hand. A reader verifies the files it reads against it. A checkpoint saved before checksums were
  recorded still loads, with a note that it is not verified.
- **Finite values.** Every floating-point tensor and number the run will load (weights; optimizer,
  LR-schedule and loss-scaler state when they are loaded; the recorded arguments) must be finite.
  A diverged run's checkpoint holds NaN weights with a valid checksum: training from it is
  pointless, so it is refused too.

Each problem is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_slapo.errors import CheckpointError

MANIFEST = "checksums.sha256"
_CHUNK = 1 << 24
_noted: set[str] = set()  # iteration directories already reported as unverified (once each)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _files(root: str) -> list[str]:
    """Every file under ``root`` but the checksums, by path relative to it, sorted."""
    return sorted(
        os.path.relpath(os.path.join(directory, name), root)
        for directory, _, names in os.walk(root)
        for name in names
        if name != MANIFEST or directory != root
    )


def checksum_share(root: str) -> dict[str, str]:
    """The SHA-256 of this rank's share of the files under ``root`` (every world-size-th of them,
    from its rank), by path relative to ``root``: the ranks' shares together cover every file."""
    rank, world = _rank_and_world()
    return {name: sha256(os.path.join(root, name)) for name in _files(root)[rank::world]}


def write_checksums(root: str, checksums: dict[str, str] | None = None) -> None:
    """Write ``root/checksums.sha256`` from ``checksums`` (path relative to ``root`` -> digest;
    default: every file's, computed here). Written in place: ``root`` is an uncommitted
    ``iter_N.tmp``, which the commit syncs and renames."""
    if checksums is None:
        checksums = {name: sha256(os.path.join(root, name)) for name in _files(root)}
    with open(os.path.join(root, MANIFEST), "w") as f:
        f.writelines(f"{checksums[name]}  {name}\n" for name in sorted(checksums))


def recorded_checksums(root: str) -> dict[str, str] | None:
    """The checksums saved with the iteration directory ``root`` (path relative to it -> hex
    digest); None for a checkpoint saved before they were recorded."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    recorded = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            digest, _, name = line.rstrip("\n").partition("  ")
            if len(digest) != 64 or not name:
                raise CheckpointError(f"{path} line {number} is not '<sha256>  <file>': the checkpoint is corrupt")
            recorded[name] = digest
    return recorded


def _note_unverified(root: str) -> None:
    if root in _noted:
        return
    _noted.add(root)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f" > note: {root} has no {MANIFEST} (saved before checksums were recorded): its files are not "
              "verified", flush=True)  # fmt: skip


def verify(root: str, names: list[str], recorded: dict[str, str] | None) -> None:
    """Check the files ``names`` (relative to the iteration directory ``root``) against its
    ``recorded`` checksums; a file saved but not listed, or missing, is refused too."""
    if recorded is None:
        _note_unverified(root)
        return
    for name in names:
        path = os.path.join(root, name)
        if name not in recorded:
            raise CheckpointError(f"checkpoint file {path} is not listed in {os.path.join(root, MANIFEST)}: it was "
                                  "not written by the save that wrote this iteration")  # fmt: skip
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint was only partly copied")
        if sha256(path) != recorded[name]:
            raise CheckpointError(f"checkpoint file {path} is corrupt: its SHA-256 differs from the one recorded "
                                  "when it was saved; restore it from a copy, or load an earlier iteration")  # fmt: skip


def verify_file(path: str) -> None:
    """Check one checkpoint file (``ITER/mp_rank_XX/model_optim_rng.pt``) against its iteration's checksums."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    verify(root, [os.path.relpath(os.path.abspath(path), root)], recorded_checksums(root))


def verify_share(root: str, skip: set[str]) -> None:
    """Check this rank's share (every world-size-th, from its rank) of the iteration's files but
    ``skip`` (those each rank checks as it reads them): together the ranks check each file once."""
    recorded = recorded_checksums(root)
    if recorded is None:
        return
    rank, world = _rank_and_world()
    verify(root, [name for name in sorted(recorded) if name not in skip][rank::world], recorded)


def _first_nonfinite(value: Any, where: str) -> str | None:
    """The first non-finite floating-point entry of a nested state, as ``where[key]...``."""
    if isinstance(value, torch.Tensor):
        finite = not value.is_floating_point() or bool(torch.isfinite(value).all())
        return None if finite else where
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} = {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        found = _first_nonfinite(item, f"{where}[{key!r}]")
        if found:
            return found
    return None


def check_finite(state: dict[str, Any], path: str, with_optimizer: bool) -> None:
    """Refuse a non-finite weight, hyper-parameter or (when ``with_optimizer``) optimizer, LR
    schedule or loss-scaler entry in the checkpoint file ``path``'s ``state``."""
    others = [k for k in state if k not in ("model", "args", "slapo", "rng_state")]  # optimizer, scheduler, scaler
    loaded = ["model", *others] if with_optimizer else ["model"]
    for key in loaded:
        found = _first_nonfinite(state.get(key), key)
        if found:
            raise CheckpointError(f"checkpoint {path} holds a non-finite value at {found}: it was saved from a diverged "
                                  "run or is corrupt; load an earlier iteration")  # fmt: skip
    try:
        recorded = json.loads(state["args"]) if isinstance(state.get("args"), str) else {}
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: its recorded arguments are not JSON ({e}); it is corrupt") from e
    found = _first_nonfinite(recorded, "args")
    if found:
        raise CheckpointError(f"checkpoint {path} records a non-finite hyper-parameter, {found}: it was saved by a "
                              "run that could not train; load an earlier iteration")  # fmt: skip
