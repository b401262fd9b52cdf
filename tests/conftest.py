"""Test-suite layout: ``tests/`` runs in one process; ``tests/distributed/`` runs under torchrun.

A plain ``pytest`` does not collect ``tests/distributed`` directly: ``tests/test_distributed.py``
launches it with ``torchrun --nproc_per_node {2,4} -m pytest tests/distributed`` so that process
start-up (torch, transformers, megatron-core imports) is paid once per world size, not per test.
"""

import os

collect_ignore = [] if "WORLD_SIZE" in os.environ else ["distributed"]
