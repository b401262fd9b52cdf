"""No rewriting: the HF model as it is, data-parallel across every rank (TP size 1)."""

from typing import Any

from megatron_slapo.schedule import Schedule

MODEL_TYPES = None  # any model: nothing here depends on its modules


def apply(sch: Schedule, config: Any = None, args: Any = None) -> None:
    """Nothing to do: engines add data parallelism, the trainer adds ``--recompute-*``."""
