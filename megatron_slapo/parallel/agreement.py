"""Agree on an error across ranks before acting on it.

A check that reads files (a checkpoint, an output directory) can fail on one rank only: rank 1
finds no ``mp_rank_01`` in a checkpoint saved at TP 1, one rank's file is truncated. If that
rank alone raised, the others would go on into the next collective and die there on a broken
connection, a traceback that hides the cause. Inside :func:`agreed_errors` every rank runs its
checks, then all of them exchange what they found (one ``all_gather_object`` on the world group)
and every rank raises the same error: the first in rank order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


def first_error(error: Exception | None) -> Exception | None:
    """The error of the lowest rank that has one (``error`` is this rank's), the same on every
    rank; collective over the world group when one is started, else ``error`` itself."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return error
    mine = None if error is None else (type(error), str(error))
    found: list[tuple[type[Exception], str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    for rank, entry in enumerate(found):
        if entry is not None:
            return error if rank == dist.get_rank() else entry[0](entry[1])
    return None


@contextlib.contextmanager
def agreed_errors(*kinds: type[Exception]) -> Iterator[None]:
    """Run the block on every rank; if it raised one of ``kinds`` on any rank, raise the first such
    error (in rank order) on every rank. Every rank must enter the block (it ends in a collective);
    an error of another kind propagates at once, as it would without the block."""
    error = None
    try:
        yield
    except kinds as e:
        error = e
    agreed = first_error(error)
    if agreed is not None:
        raise agreed
