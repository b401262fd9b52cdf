"""One error line under torchrun, and never none.

Every rank parses the same arguments and reads the same files, so an input error usually hits all
ranks, and printing it once (from rank 0) is what a user wants to read. But torchrun stops every
worker as soon as one exits: a rank that fails before rank 0 does (rank 0 still importing, say)
and exits at once would cut rank 0 off before it prints, and the user would see only torchrun's
"exitcode: 2" with no reason. So the other ranks wait, through torchrun's store, for rank 0 to say
it has reported; if it does not within :data:`RANK_0_WAIT`, the error is this rank's own (a file
missing on one node) and the rank prints it itself.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator

import torch.distributed as dist

from megatron_slapo.errors import CheckpointError, ConfigError, SchedulingError
from megatron_slapo.parallel.state import launcher_store

RANK_0_WAIT = datetime.timedelta(seconds=60)
_reports = 0  # errors this process has met: rank 0's n-th report answers the others' n-th wait


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def report(prog: str, message: str, every_rank: bool = False) -> None:
    """Print ``{prog}: error: {message}`` to stderr once for the job (from every rank if
    ``every_rank``: the message differs between ranks); return when it is safe to exit."""
    global _reports
    _reports += 1
    rank, key = _rank(), f"error_reported_{_reports}"
    store = launcher_store() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None
    if rank != 0 and not every_rank:
        if store is None:  # not under torchrun: nothing stops rank 0 before it prints
            return
        try:
            store.wait([key], RANK_0_WAIT)
            return
        except dist.DistStoreError:  # rank 0 did not fail: the error is this rank's alone
            pass
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if rank == 0 and store is not None:
        store.set(key, "1")


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Report input errors as one line (no traceback) and exit with status 2."""
    try:
        yield
    except (ConfigError, SchedulingError, FileNotFoundError) as e:
        report(prog, str(e), every_rank=isinstance(e, CheckpointError))
        sys.exit(2)
