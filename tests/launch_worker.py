"""``pretrain_gpt.py`` with a crash or a stalled save injected, for tests/test_launch.py and
tests/test_async_save.py.

With ``CRASH_AT_ITERATION=N`` in the environment, rank 1 of torchrun's first round (restart count
0) exits abruptly right after iteration N, as a process killed by a failing node would; later
rounds run normally. With ``HOLD_SAVE_AT=N``, every rank's background writer of the
``--async-save`` of iteration N writes its process id into ``HOLD_SAVE_AT.rank<R>`` in the save
directory and then waits (for an hour) before writing: the save stays in flight while training goes on.
"""

import os
import sys
import time

from megatron_slapo.training.loop import pretrain
from megatron_slapo.training.reporting import Reporter


def main() -> None:
    crash_at = int(os.environ.get("CRASH_AT_ITERATION", 0))
    if crash_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
        step = Reporter.step

        def step_then_crash(self, iteration, *args, **kwargs):
            step(self, iteration, *args, **kwargs)
            if iteration == crash_at:
                os._exit(17)

        Reporter.step = step_then_crash
    hold_at = int(os.environ.get("HOLD_SAVE_AT", 0))
    if hold_at:
        from megatron_slapo.checkpoints import dist_checkpoint

        write = dist_checkpoint._write

        def held_write(root, *args, **kwargs):
            if root.endswith(f"iter_{hold_at:07d}.tmp"):
                marker = os.path.join(os.path.dirname(root), f"HOLD_SAVE_AT.rank{os.environ['RANK']}")
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))  # the test kills each rank by it
                time.sleep(3600)
            return write(root, *args, **kwargs)

        dist_checkpoint._write = held_write
    pretrain("gpt", sys.argv[1:])


if __name__ == "__main__":
    main()
