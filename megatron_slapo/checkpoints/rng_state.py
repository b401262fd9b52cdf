"""Every random generator a run draws from, as one state: Python's, NumPy's, torch's (CPU and
CUDA) and the model-parallel RNG tracker's (dropout inside tensor-parallel regions). A checkpoint
keeps each rank's, so that a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy
import torch

from megatron_slapo.parallel.random import get_rng_tracker


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = numpy.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "tracker": get_rng_tracker().get_states(),
    }  # fmt: skip


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np = state["numpy"]
    numpy.random.set_state(
        (np["name"], np["keys"].numpy().astype(numpy.uint32), np["pos"], np["has_gauss"], np["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])
