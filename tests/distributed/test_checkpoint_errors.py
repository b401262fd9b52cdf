"""A checkpoint problem that only one rank sees reaches every rank as the same one line.

Rank 1 alone finds that a checkpoint has no ``mp_rank_01`` or that its file is truncated; before
the ranks agreed on it, rank 1 exited with the line and rank 0 died in its next collective with a
"Connection closed by peer" traceback (here: a RuntimeError instead of the SystemExit expected).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch.distributed as dist

from megatron_slapo.checkpoints import checkpoint_integrity
from megatron_slapo.checkpoints.checkpointing import FILENAME, iteration_dir
from megatron_slapo.training.loop import pretrain
from tests.distributed.runs import TINY, TP2, refused_on_every_rank

RUN = [*TINY, "--train-iters", "1", "--eval-iters", "0", "--ckpt-format", "torch"]  # the legacy layout's own files


@pytest.fixture(scope="module")
def saved(shared_tmp, cache) -> dict[str, str]:
    """Checkpoints of iteration 1: one saved at TP 1 (data-parallel over both ranks), one at TP 2."""
    found = {"tp1": os.path.join(shared_tmp, "ck-errors-tp1"), "tp2": os.path.join(shared_tmp, "ck-errors-tp2")}
    pretrain("gpt", [*RUN, "--schedule", "default", "--data-cache-path", cache, "--save", found["tp1"]])
    pretrain("gpt", [*RUN, *TP2, "--data-cache-path", cache, "--save", found["tp2"]])
    return found


def test_a_tp1_checkpoint_at_tp2_is_one_line_on_every_rank(saved, cache, capsys):
    line = refused_on_every_rank([*RUN, *TP2, "--data-cache-path", cache, "--load", saved["tp1"]], capsys)
    assert f"{iteration_dir(saved['tp1'], 1)} holds mp_rank_00: it was written with another tensor/pipeline-parallel " \
           "size than this run's (mp_rank_01 of TP 2 x PP 1)" in line  # fmt: skip


@pytest.mark.parametrize("checksums", [True, False], ids=["checksummed", "without-checksums"])
def test_one_ranks_truncated_file_is_one_line_on_every_rank(checksums, saved, shared_tmp, cache, capsys):
    ck = os.path.join(shared_tmp, f"ck-errors-truncated-{checksums}")
    broken = os.path.join(iteration_dir(ck, 1), "mp_rank_01", FILENAME)
    if dist.get_rank() == 0:
        shutil.copytree(saved["tp2"], ck)
        with open(broken, "r+b") as f:
            f.truncate(os.path.getsize(broken) // 2)
        if not checksums:
            os.remove(os.path.join(iteration_dir(ck, 1), checkpoint_integrity.MANIFEST))
    dist.barrier()
    line = refused_on_every_rank([*RUN, *TP2, "--data-cache-path", cache, "--load", ck, "--train-iters", "2"], capsys)
    expected = (
        f"checkpoint file {broken} is corrupt: its SHA-256 differs" if checksums else f"cannot read checkpoint {broken}"
    )
    assert expected in line, line
