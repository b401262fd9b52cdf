"""Base of the modules whose one Linear stacks the rows of several original layers (fused q|k|v,
:mod:`~megatron_slapo.kernels.qkv`): one GEMM where the model had several, reading the input once.
(The schedules fuse without a new module: :mod:`~megatron_slapo.kernels.shared_input`.)

The fused Linear takes the originals' weights (pretrained ones carry over) and remembers the
originals weakly (:meth:`FusedRows.param_origins`), so that ``build`` initialises it as the
concatenation of what they would have been initialised to, and ``Verify`` compares its gradient
with the concatenation of theirs.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

ParamOrigins = dict[str, tuple[int, list[tuple[nn.Module, str]]]]


class FusedRows(nn.Module):
    """A module with one Linear, named by :attr:`FUSED`, made of the rows of other Linear layers."""

    FUSED = "proj"  # the attribute holding the fused Linear

    def __init__(self) -> None:
        super().__init__()
        self._origins: list[weakref.ref] = []  # weak: the originals must not stay alive for this

    def take_rows(self, layers: list[nn.Linear]) -> None:
        """Give the fused Linear (built on the meta device) the layers' rows, one after the other
        (unless they are on meta too, then only their dtype), and remember the layers."""
        fused, first = getattr(self, self.FUSED), layers[0]
        fused.to(dtype=first.weight.dtype)
        if not first.weight.is_meta:
            for name in ("weight", "bias") if first.bias is not None else ("weight",):
                rows = torch.cat([getattr(layer, name).detach() for layer in layers])
                setattr(fused, name, nn.Parameter(rows, requires_grad=getattr(first, name).requires_grad))
        self._origins = [weakref.ref(layer) for layer in layers]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_origins"] = []  # weak references neither pickle nor mean anything elsewhere
        return state

    def param_origins(self) -> ParamOrigins:
        """``{parameter: (dim, [(original layer, its parameter), ...])}``: each fused parameter is the
        concatenation along ``dim`` of the originals' (empty if the originals are gone)."""
        layers = [ref() for ref in self._origins]
        if not layers or any(layer is None for layer in layers):
            return {}
        fused = getattr(self, self.FUSED)
        names = ["weight"] + (["bias"] if fused.bias is not None else [])
        return {f"{self.FUSED}.{name}": (0, [(layer, name) for layer in layers]) for name in names}
