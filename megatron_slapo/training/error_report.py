"""Every failure as one line, printed once for the job, and named by torchrun as the root cause.

Input errors. Every rank parses the same arguments and reads the same files (and checks that one
rank makes are agreed across ranks), so an input error usually hits every rank with the same
message, and printing it once (from rank 0) is what a user wants to read. But torchrun stops every
worker as soon as one exits: a rank that fails before rank 0 does (rank 0 still importing, say) and
exits at once would cut rank 0 off before it prints, and the user would see no reason. So the other
ranks wait, through torchrun's store, for rank 0's line; if it is theirs they stay silent, if it
differs or does not come within :data:`RANK_0_WAIT` (the error is this rank's own: a file missing on
one node) they print their own.

A peer's death. When a rank dies (killed, out of memory, a failed node), the others fail in their
next collective with the backend's "Connection closed by peer" and a long traceback that says
nothing about why. :func:`lost_peers` turns that into one line per surviving rank naming the
collective, and exits non-zero, so torchrun still stops the job (or restarts it with
``--max-restarts``).

The launcher. torchrun ends a failed job with a summary whose "Root Cause" shows the first failed
rank's torchelastic error file. :func:`root_cause` leaves the one line there (or, for a bug, the
traceback, as torch's ``@record`` does), instead of "To enable traceback see ...".

A Ctrl-C. The terminal sends SIGINT to torchrun (its workers run in sessions of their own), which
forwards it to every worker. :func:`interruptions` turns the ``KeyboardInterrupt`` of each rank
into one line from rank 0 saying where the run stopped, and exit status 130.

Leaving. After an error or an interruption the process ends at once (:func:`exit_now`), not
through the interpreter's shutdown, which tears gloo's threads down while they run (``terminate
called without an active exception``: SIGABRT instead of the exit status).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from megatron_slapo.compat.distributed import collective_in, record_root_cause
from megatron_slapo.errors import ConfigError, SchedulingError
from megatron_slapo.parallel.state import launcher_store

RANK_0_WAIT = datetime.timedelta(seconds=60)
# What gloo (and NCCL) say in the collective that was cut off by a peer's death.
PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "remote process exit")
# How long a survivor of a peer's death waits, under torchrun, before exiting by itself: torchrun
# names the first failure it sees (to the second) as the root cause, and the survivor must not race
# the rank that died. Torchrun stops it much sooner when that rank ran on the same node.
PEER_LOSS_GRACE = 5.0
INTERRUPTED = 130  # the status of a process stopped by SIGINT, as a shell reports it (128 + 2)

_reports = 0  # errors this process has met: rank 0's n-th line answers the others' n-th wait
_last_line: str | None = None  # the line this process last reported, for the launcher's summary
_interrupted = False  # a SIGINT arrived while :func:`interruptions` listened


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _agent_store() -> dist.Store | None:
    return launcher_store() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else None


def report(prog: str, message: str) -> None:
    """Print ``{prog}: error: {message}`` to stderr once for the job: rank 0 prints it; another rank
    prints it only when rank 0 did not report the same line. Return when it is safe to exit."""
    global _reports, _last_line
    _reports += 1
    rank, key, line = _rank(), f"error_reported_{_reports}", f"{prog}: error: {message}"
    _last_line = line
    store = _agent_store()
    if rank != 0:
        if store is None:  # not under torchrun: nothing stops rank 0 before it prints
            return
        try:
            store.wait([key], RANK_0_WAIT)
            if store.get(key).decode() == line:
                return
        except dist.DistStoreError:  # rank 0 did not fail: the error is this rank's alone
            pass
    print(line, file=sys.stderr, flush=True)
    if rank == 0 and store is not None:
        store.set(key, line)


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Report input errors as one line (no traceback) and exit with status 2."""
    try:
        yield
    except (ConfigError, SchedulingError, FileNotFoundError) as e:
        report(prog, str(e))
        sys.exit(2)


def _peer_loss(error: BaseException) -> str | None:
    """The backend's words for a peer's death, where ``error`` (or what it was raised from) is one."""
    while error is not None:
        if isinstance(error, RuntimeError):  # torch.distributed.DistBackendError is one
            found = [text for text in PEER_LOSS if text in str(error)]
            if found:
                return found[0]
        error = error.__cause__
    return None


def _awaited_in(tb: TracebackType | None) -> str:
    """Where a collective that failed outside ``torch.distributed``'s functions was waited on (an
    asynchronous one's ``Work.wait()``, as megatron-core's gradient reduction calls it): the
    innermost frame outside torch, by function and file."""
    frames = [frame for frame, _ in traceback.walk_tb(tb) if f"{os.sep}torch{os.sep}" not in frame.f_code.co_filename]
    if not frames:
        return "a collective"
    code = frames[-1].f_code
    return f"a collective awaited in {code.co_name} ({os.path.basename(code.co_filename)})"


@contextlib.contextmanager
def lost_peers(prog: str) -> Iterator[None]:
    """Report a collective cut off by another rank's death as one line naming this rank and the
    collective, and exit with status 1; any other error passes through."""
    try:
        yield
    except RuntimeError as e:
        reason = _peer_loss(e)
        if reason is None or _interrupted:  # the peer left on a Ctrl-C, as this rank does: no line
            raise
        op = collective_in(e.__traceback__) or _awaited_in(e.__traceback__)
        line = (f"{prog}: error: rank {_rank()} stopped: another rank died during {op} ({reason}); "
                "its own output above, or the launcher's summary, says why")  # fmt: skip
        global _last_line
        _last_line = line
        print(line, file=sys.stderr, flush=True)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT") is not None:
            time.sleep(PEER_LOSS_GRACE)
        sys.exit(1)


@contextlib.contextmanager
def root_cause() -> Iterator[None]:
    """Around an entry point: when the process exits with an error, leave it in torchelastic's
    error file (a no-op outside torchrun), so that the launcher's summary names it: the line last
    reported for an exit with a status, the traceback for an exception (as torch's ``@record``)."""
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None) and _last_line is not None:
            record_root_cause(_last_line)
        raise
    except Exception as e:
        get_error_handler().record_exception(e)
        raise


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """Python's own SIGINT handler, remembering that the run was interrupted."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def interruptions(prog: str, where: Callable[[], str]) -> Iterator[None]:
    """End a run stopped by SIGINT with one line from rank 0, ``{prog}: {where()}`` (where it
    stopped and what was last saved), and status :data:`INTERRUPTED`, instead of a traceback from
    every rank. Once a SIGINT arrived, whatever the ``KeyboardInterrupt`` became on its way up
    (torch's distributed checkpoint wraps it in a ``CheckpointException``), or a collective that
    failed because an interrupted peer left first, ends the same way."""
    global _interrupted
    _interrupted = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    except BaseException as e:
        if not (_interrupted or isinstance(e, KeyboardInterrupt)):
            raise
        if _rank() == 0:
            print(f"{prog}: {where()}", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted = False


def exit_now(code: int | str | None) -> NoReturn:
    """End the process with ``sys.exit``'s ``code`` (None: 0; a message: printed, then 1) once its
    output is flushed, skipping the interpreter's shutdown: it would tear gloo's threads down while
    they run, and a rank must not wait there for peers that are gone. By then the line is printed,
    the launcher's error file written and TensorBoard's events flushed."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
