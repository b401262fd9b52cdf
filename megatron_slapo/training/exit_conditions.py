"""When to stop training early: ``--exit-duration-in-mins`` and ``--exit-signal-handler``.

Both are decided the same on every rank, as in Megatron-LM: after each step the ranks all-reduce
(max) whether any of them received ``--exit-signal`` and the longest time any of them has run, so
they all stop after the same step and can save one consistent checkpoint. The signal is SIGTERM by
default, what SLURM sends at pre-emption or time limit (and what torchrun forwards to its workers
when it is itself terminated); SIGINT makes a Ctrl-C stop the run that way. The handler only
records it, so the step in flight finishes normally; a second SIGINT goes to the handler it
replaced, which stops the run at once (a ``KeyboardInterrupt``, as without the handler).
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import torch
import torch.distributed as dist


class ExitConditions:
    """Watches the run's wall-clock time and the signal ``signum`` (``--exit-signal``); :meth:`check`
    is a collective when either is on.

    ``started`` is when the run began (``time.time()``); the duration counts from there, set-up
    included, like Megatron-LM's ``_TRAIN_START_TIME``. Use as a context manager, so that the
    previous handler of the signal comes back however training ends.
    """

    def __init__(self, duration_minutes: float | None, handle_signal: bool, started: float,
                 signum: int = signal.SIGTERM) -> None:  # fmt: skip
        self.duration, self.handle_signal, self.started, self.signum = duration_minutes, handle_signal, started, signum
        self.received = False
        self.interrupted = False  # the ranks agreed to stop on a SIGINT: the run ends as a Ctrl-C does
        self._previous: signal.Handlers | None = None

    def __enter__(self) -> ExitConditions:
        if self.handle_signal:
            self._previous = signal.signal(self.signum, self._on_signal)
            # Restart system calls the signal interrupts (a rank blocked in a socket read of a
            # collective) rather than fail them with EINTR: the step must finish normally.
            signal.siginterrupt(self.signum, False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle_signal:
            signal.signal(self.signum, self._previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received and signum == signal.SIGINT and callable(self._previous):
            self._previous(signum, frame)  # Ctrl-C again: handled as without the handler, the run stops at once
        self.received = True

    def check(self) -> str | None:
        """Why to stop now (Megatron-LM's message), or None. Every rank gets the same answer."""
        if self.duration is None and not self.handle_signal:
            return None
        minutes = (time.time() - self.started) / 60.0
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flags = torch.tensor([float(self.received), minutes], dtype=torch.float64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        received, minutes = bool(flags[0].item()), flags[1].item()
        if received:
            self.interrupted = self.signum == signal.SIGINT
            return f"exiting program after receiving {signal.Signals(self.signum).name}."
        if self.duration is not None and minutes > self.duration:
            return f"exiting program after {minutes:.3f} minutes (--exit-duration-in-mins {self.duration:g})"
        return None
