"""A gated MLP (Llama's ``down(act(gate(x)) * up(x))``) with gate and up as one projection.

One GEMM of twice the width instead of two, reading the input once; under tensor parallelism the
fused projection is column-parallel with stride 2 (:class:`FuseGateUp`), so each rank holds its
part of gate, then its part of up, and one all-reduce covers the input gradient of both (Megatron's
``linear_fc1`` with ``gated_linear_unit``).

Not in ``llama_tp`` by default yet: the DeepSpeed and FSDP engines save and load checkpoints by
parameter name and tensor, not through the modules' state-dict hooks that keep HF's names here.
With the megatron and ddp engines it round-trips exactly (``tests/distributed/test_fused_tp.py``).

Nothing changes outside the module: pretrained weights are concatenated into the fused projection,
``build`` initialises it as the concatenation of what the two layers would have been initialised to
and ``Verify`` compares its gradient with theirs (:class:`~megatron_slapo.kernels.fused_rows.FusedRows`), and the
module's ``state_dict`` keeps HF's names (``gate_proj.weight``, ``up_proj.weight``, each this
rank's shard), so checkpoints, ``--load-hf`` and ``tools/convert_checkpoint.py`` work as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from megatron_slapo.kernels.fused_rows import FusedRows
from megatron_slapo.parallel.plans import ColumnParallel

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

NAMES = ("gate_proj", "up_proj")  # HF's gated MLP layers, in the fused projection's order


class FusedGateUpMLP(FusedRows):
    """``down_proj(act_fn(gate) * up)`` where ``gate, up = gate_up_proj(x).chunk(2, -1)``."""

    FUSED = "gate_up_proj"

    def __init__(self, hidden: int, intermediate: int, act_fn: nn.Module, down_proj: nn.Module, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias, device="meta")
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.register_state_dict_post_hook(_split_state)
        self.register_load_state_dict_pre_hook(_fuse_state)

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> FusedGateUpMLP:
        """The fused form of an HF gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``)."""
        gate = mlp.gate_proj
        fused = cls(gate.in_features, gate.out_features, mlp.act_fn, mlp.down_proj, gate.bias is not None)
        fused.take_rows([gate, mlp.up_proj])
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _split_state(module: FusedGateUpMLP, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: the fused tensors as HF's two, each this rank's rows of its layer."""
    for name in ("weight", "bias"):
        fused = state.pop(f"{prefix}gate_up_proj.{name}", None)
        if fused is None:
            continue
        sharded = getattr(getattr(module.gate_up_proj, name), "tensor_model_parallel", False)
        for layer, view in zip(NAMES, fused.detach().chunk(2, dim=0), strict=True):
            half = view.clone()  # its own storage: safetensors refuses tensors that share one
            if sharded:  # each half is a plain row shard of its own layer (stride 1)
                half.tensor_model_parallel, half.partition_dim, half.partition_stride = True, 0, 1
            state[f"{prefix}{layer}.{name}"] = half


def _fuse_state(module: FusedGateUpMLP, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: HF's two tensors (this rank's rows of each) back into one."""
    for name in ("weight", "bias"):
        keys = [f"{prefix}{layer}.{name}" for layer in NAMES]
        if all(key in state for key in keys):
            state[f"{prefix}gate_up_proj.{name}"] = torch.cat([state.pop(key) for key in keys])


@dataclass(frozen=True)
class FuseGateUp:
    """Plan placement on a gated MLP: fuse gate|up (:class:`FusedGateUpMLP`), column-parallel with
    stride 2 and its input gradient all-reduced once (sequence parallelism: all-gathered input)."""

    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        sch.replace(FusedGateUpMLP.from_mlp(sch.mod))
        ColumnParallel(stride=2, sequence_parallel=self.sequence_parallel).apply(sch["gate_up_proj"])
