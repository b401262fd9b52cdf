"""Mixture-of-experts blocks under tensor parallelism: every expert's MLP split across the ranks.

transformers 5 stores a block's experts as one module with 3-D weights (mixtral, qwen3_moe, ...):
``gate_up_proj`` (experts x 2·intermediate x hidden, gate rows then up rows) and ``down_proj``
(experts x hidden x intermediate), called as ``experts(hidden_states, top_k_index, top_k_weights)``
on the tokens flattened to rows, after a router that picks ``k`` experts per token. HF's plans call
this ``moe_tp_experts`` with ``packed_colwise`` gate|up and ``rowwise`` down; Megatron's MoE layer
shards its experts' feature dimension the same way (``--tensor-model-parallel-size`` on the
experts). :class:`TensorParallelExperts` places it:

- each rank keeps its part of every expert's intermediate features: its rows of gate and of up
  (stride 2, so ``chunk(2)`` in HF's forward still splits gate from up), and the same columns of
  down. The experts' output on a rank is then a partial sum, all-reduced once (Megatron's g); the
  router stays whole and replicated, as in Megatron (shared experts, where the plan splits them,
  are a tensor-parallel MLP of their own);
- the layout is read from the module (what HF's ``use_experts_implementation`` records:
  transposed, interleaved gate/up), not from the plan's words for its weights, which vary
  (``packed_colwise``, ``colwise``, ``packed_rowwise``) for the same layout;
- backward, the gradients of both inputs that carry one (the token rows and the routing weights)
  are partial sums and are all-reduced (Megatron's f, on each). The router's own contribution to the
  hidden states' gradient is whole on every rank, which is why the reduction sits on the experts'
  inputs and not on the block's (it would count the router ``t`` times);
- under ``--sequence-parallel`` the block runs on this rank's tokens, the router included (its
  weights' gradients are then partial sums, tagged ``sequence_parallel``); the experts all-gather
  the token rows, routing weights and choices, and reduce-scatter their output back to this rank's
  tokens. Tokens are independent in an MoE layer, so which rank's rows come first does not matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_slapo.compat.transformers_internals import has_default_experts_gate
from megatron_slapo.parallel import collectives as C

if TYPE_CHECKING:
    from megatron_slapo.schedule import Schedule

TOKENS = 0  # the experts see tokens flattened to rows


def experts_arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """``(hidden_states, top_k_index, top_k_weights)`` of a call to an HF experts module, taken out
    of ``kwargs`` where given by name (a pre-hook hands them on positionally)."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args) + [kwargs.pop(name) for name in names[len(args) :] if name in kwargs]
    if len(values) != 3:
        raise RuntimeError(f"{type(module).__name__} was called without ({', '.join(names)})")
    return tuple(values)


class ExpertsInput:
    """Forward pre-hook of a tensor-parallel experts module: the collectives on its inputs
    ``(hidden_states, top_k_index, top_k_weights)`` (see the module docstring)."""

    def __init__(self, group: C.Group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def __deepcopy__(self, memo: dict) -> ExpertsInput:
        return self  # holds a process group handle, shared rather than copied

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = experts_arguments(module, args, kwargs)
        if self.sequence_parallel:
            hidden = C.all_gather(hidden, TOKENS, self.group, "reduce_scatter")
            weights = C.all_gather(weights, TOKENS, self.group, "reduce_scatter")
            index = C.gather_tensor(index, TOKENS, self.group)
        else:
            hidden, weights = C.reduce_backward(hidden, self.group), C.reduce_backward(weights, self.group)
        return (hidden, index, weights), kwargs


def experts_layout(mod: nn.Module) -> tuple[int, int, int]:
    """(gate|up's output axis, down's input axis, gate|up's stride) of an HF experts module, read
    from what HF's ``use_experts_implementation`` records of its weights' layout."""
    if getattr(mod, "has_bias", False) or getattr(mod, "has_post_expert_norm", False):
        raise ValueError("experts with biases or a norm after each expert are not split yet")
    if not getattr(mod, "has_gate", True) or not isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor):
        raise ValueError("expected gated experts with a packed gate_up_proj weight (HF's layout)")
    if not isinstance(getattr(mod, "down_proj", None), torch.Tensor) or {
        mod.gate_up_proj.dim(),
        mod.down_proj.dim(),
    } != {3}:
        raise ValueError("expected 3-D gate_up_proj and down_proj weights (experts x out x in)")
    if not has_default_experts_gate(type(mod)):  # HF's chunk(2): gate half, up half
        raise ValueError("its own _apply_gate splits gate from up in a way the split does not know")
    transposed = getattr(mod, "is_transposed", False)  # weights stored (experts x in x out)
    stride = 2 if getattr(mod, "is_concatenated", True) else 1  # interleaved gate/up rows split as they are
    return (2 if transposed else 1), (1 if transposed else 2), stride


@dataclass(frozen=True)
class TensorParallelExperts:
    """Plan placement on an HF experts module (``moe_tp_experts``): split every expert's
    intermediate features over the tensor-parallel ranks, reduce once per block (module docstring)."""

    sequence_parallel: bool = False

    def apply(self, sch: Schedule) -> None:
        try:
            gate_up_axis, down_axis, stride = experts_layout(sch.mod)
        except ValueError as e:
            raise sch._error(f"{type(sch.mod).__name__}: {e}") from None
        sch.shard("gate_up_proj", axis=gate_up_axis, stride=stride)
        sch.shard("down_proj", axis=down_axis)
        sch.hook("fwd_pre", ExpertsInput(sch.group, self.sequence_parallel), with_kwargs=True)
        # The router's weights, under sequence parallelism, see this rank's tokens: split_layers tags
        # them with the layer's other unsplit parameters.
        sch.sync("fwd_post", "reduce_scatter" if self.sequence_parallel else "all_reduce", axis=TOKENS)
