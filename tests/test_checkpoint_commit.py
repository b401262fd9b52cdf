"""Committing a checkpoint: synced before it is published, and loadable after a crash at any step."""

import os
import shutil

import pytest
import torch

from megatron_slapo.checkpoints import checkpoint_files, checkpointing
from megatron_slapo.checkpoints.checkpoint_files import LATEST, commit, iteration_dir
from megatron_slapo.checkpoints.checkpointing import FILENAME
from megatron_slapo.parallel.state import Layout

LAYOUT = Layout(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=0, dp_group=None)


class Killed(BaseException):
    """The process dies here (nothing after this point of the commit runs)."""


def write_tmp(save: str, iteration: int, content: str) -> None:
    """What every rank has written before rank 0 commits: ``iter_N.tmp/mp_rank_00/...``."""
    tmp = iteration_dir(save, iteration) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "mp_rank_00"))
    torch.save({"iteration": iteration, "content": content}, os.path.join(tmp, "mp_rank_00", FILENAME))
    with open(os.path.join(tmp, "distrib_optim.pt"), "wb") as f:  # an engine's own file
        f.write(b"\0" * 16)


def loaded(save: str) -> tuple[int, str]:
    """What a resuming run reads: the iteration ``latest`` names, and the content of its file."""
    state = checkpointing.read(checkpointing.checkpoint_file(save, LAYOUT))
    return checkpointing.latest_iteration(save), state["content"]


def crash_on_replace(monkeypatch, n: int) -> None:
    """Kill the commit at its ``n``-th rename (``os.replace``)."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == n:
            raise Killed(f"killed before renaming {src} -> {dst}")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


# A re-save of iteration 8 renames: iter_8 -> iter_8.old, iter_8.tmp -> iter_8, latest.partial -> latest.
@pytest.mark.parametrize("crash_at, expected", [(1, "v1"), (2, "v1"), (3, "v2")])
def test_re_saving_an_iteration_killed_at_any_rename_leaves_latest_loadable(tmp_path, monkeypatch, crash_at, expected):
    save = str(tmp_path)
    write_tmp(save, 4, "first")
    commit(save, 4)
    write_tmp(save, 8, "v1")
    commit(save, 8)
    write_tmp(save, 8, "v2")
    crash_on_replace(monkeypatch, crash_at)
    with pytest.raises(Killed):
        commit(save, 8)
    monkeypatch.undo()
    assert loaded(save) == (8, expected)  # never a latest naming a missing directory
    write_tmp(save, 8, "v3")  # the next run saves iteration 8 again
    commit(save, 8)
    assert loaded(save) == (8, "v3")
    assert sorted(os.listdir(save)) == ["iter_0000004", "iter_0000008", LATEST]


# A first save of iteration 8 renames: iter_8.tmp -> iter_8, latest.partial -> latest.
@pytest.mark.parametrize("crash_at, expected", [(1, (4, "first")), (2, (4, "first")), (3, (8, "new"))])
def test_a_first_save_killed_at_any_rename_leaves_latest_loadable(tmp_path, monkeypatch, crash_at, expected):
    save = str(tmp_path)
    write_tmp(save, 4, "first")
    commit(save, 4)
    write_tmp(save, 8, "new")
    crash_on_replace(monkeypatch, crash_at)
    if crash_at <= 2:
        with pytest.raises(Killed):
            commit(save, 8)
    else:
        commit(save, 8)
    monkeypatch.undo()
    assert loaded(save) == expected


def test_every_file_and_directory_is_synced_before_latest_is_replaced(tmp_path, monkeypatch):
    save = str(tmp_path)
    write_tmp(save, 4, "first")
    commit(save, 4)
    write_tmp(save, 4, "again")
    tmp = iteration_dir(save, 4) + ".tmp"
    wanted = {os.path.join(d, name) for d, _, files in os.walk(tmp) for name in files}
    wanted |= {d for d, _, _ in os.walk(tmp)}
    events, fd_paths = [], {}  # fd -> path, recorded where commit opens it (no /proc: any OS)
    real_open, real_os_open, real_fsync, real_replace = open, os.open, os.fsync, os.replace

    def os_open(path, *args, **kwargs):
        fd = real_os_open(path, *args, **kwargs)
        fd_paths[fd] = str(path)
        return fd

    def builtin_open(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        fd_paths[f.fileno()] = str(path)
        return f

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(checkpoint_files, "open", builtin_open, raising=False)
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", fd_paths[fd])), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", dst)), real_replace(src, dst))[1])
    commit(save, 4)
    monkeypatch.undo()
    publish = events.index(("replace", os.path.join(save, LATEST)))
    final_rename = events.index(("replace", iteration_dir(save, 4)))
    synced_before_rename = {path for kind, path in events[:final_rename] if kind == "fsync"}
    assert wanted <= synced_before_rename, wanted - synced_before_rename
    between = events[final_rename:publish]
    assert ("fsync", save) in between  # the renames are durable before latest names the iteration
    assert ("fsync", os.path.join(save, LATEST) + ".partial") in between
    assert ("fsync", save) in events[publish:]
    assert loaded(save) == (4, "again")
