"""One device, GPT-2 as fast as it goes: drop-in kernels, every layer compiled (torch.compile).

The one-GPU recipe (Slapo's ``gpt`` single-device schedule): no sharding, so it runs on one device
or data-parallel ranks (TP size 1). Trade speed for memory with ``--checkpoint-ratio R``, which
recomputes the first ``R`` of the layers; see ``tools/bench.py`` for what it gains over HF eager.
"""

from typing import Any

from megatron_slapo.plans.kernel_swap import swap_in_kernels
from megatron_slapo.schedule import Schedule

MODEL_TYPES = ("gpt2",)  # HF config.model_type values this schedule is written for


def apply(sch: Schedule, config: Any, args: Any = None) -> None:
    swap_in_kernels(sch)
    for layer in range(config.n_layer):
        sch[f"transformer.h.{layer}"].compile()
