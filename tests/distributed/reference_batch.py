"""Several single-process reference runs in one plain process: ``python reference_batch.py RUNS.json``.

Each run is ``[task, argv]``, trained as ``pretrain_{task}.py argv`` would be, one after another,
the process groups torn down between them. Starting a process costs seconds of imports (torch,
transformers, megatron-core); a module with many references pays them once this way.
"""

import json
import sys

from megatron_slapo import parallel
from megatron_slapo.training.loop import pretrain

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for task, argv in runs:
        pretrain(task, argv)
        parallel.destroy()
