"""Initial values that a model leaves to a module's constructor, for models built on the meta device.

The trainer builds a model on the meta device and ``build`` gives every tensor its initial value by
calling the model's init function (HF's ``_init_weights``). A few modules compute theirs in
``__init__`` instead and HF's init function never writes them: Apertus' xIELU activation (its two
slopes, from ``alpha_p_init`` and ``alpha_n_init``, and its constants). On the meta device those
values are lost; for the modules listed here a CPU twin is constructed as the model's code
constructs it and its tensors are the initial values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# class name -> the constructor call the model's code makes (Apertus' MLP: ACT2CLS["xielu"](dtype=config.dtype))
_TWINS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "XIELUActivation": lambda module: type(module)(dtype=module.alpha_p.dtype),
}


def constructed_values(module: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> initial value of ``module``'s own parameters and buffers, as its constructor sets them;
    empty for a module not listed (its values must come from the init function)."""
    twin = _TWINS.get(type(module).__name__)
    if twin is None:
        return {}
    with torch.device("cpu"):
        built = twin(module)
    return {name: t for name, t in (*built.named_parameters(recurse=False), *built.named_buffers(recurse=False))}
