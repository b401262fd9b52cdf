"""``pretrain_gpt.py`` with a crash injected, for tests/test_launch.py.

With ``CRASH_AT_ITERATION=N`` in the environment, rank 1 of torchrun's first round (restart count
0) exits abruptly right after iteration N, as a process killed by a failing node would; later
rounds run normally.
"""

import os
import sys

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
    pretrain("gpt", sys.argv[1:])


if __name__ == "__main__":
    main()
