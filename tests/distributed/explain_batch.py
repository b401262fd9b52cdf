"""Several ``tools/explain.py`` runs in one plain process: ``python explain_batch.py RUNS.json``.

Each run is the argument list of one ``tools/explain.py`` command, run one after another (each plan
over its own fake process group, torn down after it). Starting a process costs seconds of imports
(torch, transformers, megatron-core, DeepSpeed); a module that plans many runs pays them once this way.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tools/

from tools.explain import main  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    for argv in runs:
        main(argv)
