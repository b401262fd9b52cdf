"""An MoE model's auxiliary load-balancing loss, added to the trainer's loss with its one-device value.

HF's MoE language models add it in their own forward when ``output_router_logits`` is on:
``loss += router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, mask)``,
where ``router_logits`` holds each MoE layer's ``(tokens, experts)`` router logits. The trainer
computes its loss from the logits itself (``tasks.py``), so it adds this term itself, with the same
function (the one in the model's own module) over the router logits of every token of the
micro-batch, as one device computes it:

- tensor parallelism: the router is whole on every rank and sees every token; the function runs on
  its logits as they are, the same value on every rank;
- ``--sequence-parallel``: each rank's router sees its chunk of the sequence, and the function is not
  a sum over tokens (it multiplies the layers' mean routing counts by their mean probabilities). The
  logits are all-gathered along the tokens first (backward: this rank's rows of the gradient), so
  every rank computes the one-device value and its router gets its own tokens' gradient. The rows
  come in another order than on one device (each rank's chunk of every sample in turn): the function
  only sums over rows, and no mask is passed (no padding in a GPT batch; Megatron counts every token);
- data and expert parallelism: each rank's micro-batch is one of a single process's micro-batches
  (the same ``--micro-batch-size``), so the loss per micro-batch is a single process's with
  gradient accumulation;
- pipeline parallelism is refused: the function pools the statistics of all layers before
  multiplying them, and the layers sit on different stages.

The model's forward, asked for the router logits, computes the loss too (HF returns the logits only
with it): that value, on this rank's rows only under sequence parallelism, is left unused, a
softmax and top-k per layer. The loss counts each expert's top-k choices, a step function: where
the rounding of a parallel layout decides a near tie of two experts the other way, its value moves
by ``experts / rows`` times the two experts' mean probabilities' difference (its gradient, through
the probabilities only, hardly at all).

Megatron-LM's switch is ``--moe-aux-loss-coeff``; here a positive value turns the loss on with that
coefficient, and 0 (the default) leaves it to the model's config (``output_router_logits``,
``router_aux_loss_coef``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from megatron_slapo.errors import ConfigError
from megatron_slapo.parallel import collectives as C

TOKENS = 0  # router logits are (tokens, experts): the batch flattened to rows
# What HF's CausalLM forwards pass: (router logits, num_experts, top_k, attention_mask)
ARGUMENTS = ("gate_logits", "num_experts", "top_k", "attention_mask")


@dataclass(frozen=True)
class LoadBalancingLoss:
    """The model's load-balancing loss over a micro-batch's router logits, and its coefficient.

    ``sequence_group``: the tensor-parallel group when ``--sequence-parallel`` gives each rank's
    routers only its chunk of the tokens (they are gathered over it), else None.
    """

    function: Callable[..., torch.Tensor]  # the family's load_balancing_loss_func
    num_experts: int
    top_k: int
    coefficient: float
    sequence_group: C.Group = None

    def __call__(self, router_logits: tuple[torch.Tensor, ...], tokens: int) -> torch.Tensor:
        """The loss, unscaled (fp32 scalar), of a micro-batch of ``tokens`` tokens from the model's
        ``router_logits`` (one ``(rows, experts)`` tensor per MoE layer)."""
        if self.sequence_group is not None:
            router_logits = tuple(C.all_gather(x, TOKENS, self.sequence_group, "split") for x in router_logits)
        rows = {x.shape[TOKENS] for x in router_logits}
        if rows != {tokens}:  # a router that saw other tokens than the micro-batch's: not the one-device value
            raise RuntimeError(f"router logits of {sorted(rows)} tokens for a micro-batch of {tokens}")
        return self.function(tuple(router_logits), self.num_experts, self.top_k, None)


def load_balancing_loss(model: nn.Module, args: argparse.Namespace, tp_group: C.Group) -> LoadBalancingLoss | None:
    """The load-balancing loss the run adds to ``model``'s language-modelling loss, or None: on with
    ``--moe-aux-loss-coeff`` > 0 (that coefficient), else as ``model.config`` says
    (``output_router_logits``, ``router_aux_loss_coef``). What it cannot compute as one device
    does is a :class:`ConfigError`, raised before any compute."""
    flag, config = args.moe_aux_loss_coeff, model.config
    if flag < 0:
        raise ConfigError(f"--moe-aux-loss-coeff {flag:g}: give a coefficient >= 0 (0: the model's config decides)")
    if not flag and not getattr(config, "output_router_logits", False):
        return None
    coefficient = flag or getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    name = type(model).__name__
    function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    if not flag and (not coefficient or function is None):  # the config's switch adds nothing to HF's loss either
        return None
    if function is None:
        raise ConfigError(f"--moe-aux-loss-coeff {flag:g}: HF's {name} defines no load-balancing loss; leave the "
                          "flag at 0")  # fmt: skip
    if flag:
        on, off = f"--moe-aux-loss-coeff {flag:g}", "leave the flag at 0"
    else:
        on, off = (
            f"the model's config (output_router_logits, coefficient {coefficient:g})",
            "set output_router_logits false",
        )
    takes = tuple(inspect.signature(function).parameters)
    if takes != ARGUMENTS or not hasattr(model, "num_experts") or not hasattr(model, "num_experts_per_tok"):
        raise ConfigError(f"{on}: HF's {name} computes its load-balancing loss from arguments the trainer does not "
                          f"know how to give ({', '.join(takes)}); {off}")  # fmt: skip
    if args.pipeline_model_parallel_size > 1:
        raise ConfigError(f"{on}: the load-balancing loss pools the routing statistics of every layer, which "
                          f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} puts on different "
                          f"stages; train without pipeline parallelism or {off}")  # fmt: skip
    if args.reset_position_ids or args.reset_attention_mask:
        raise ConfigError(f"{on}: HF's {name} computes the load-balancing loss in its forward with the attention "
                          "mask as a padding mask, which the 4D mask of --reset-position-ids / "
                          f"--reset-attention-mask is not; drop those flags or {off}")  # fmt: skip
    group = tp_group if args.sequence_parallel and C.group_size(tp_group) > 1 else None
    return LoadBalancingLoss(function, model.num_experts, model.num_experts_per_tok, float(coefficient), group)
