"""Vocabulary parallelism: the embedding table and the LM head split along the vocabulary.

Rank ``r`` of a group of ``n`` holds rows ``[r*V/n, (r+1)*V/n)`` of the (tied) ``V x H`` table.
The embedding looks up only the ids in its range and the partial results are summed across ranks;
the LM head produces only its slice of the logits, and the cross-entropy is computed from those
slices with two small all-reduces (the maxima; the target logits with the sums of exponentials)
instead of gathering ``B x S x V`` logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_slapo.parallel.collectives import Group, group_rank, group_size


def vocab_range(local_size: int, group: Group) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows held by this rank."""
    start = group_rank(group) * local_size
    return start, start + local_size


def vocab_parallel_embedding(
    ids: torch.Tensor, weight: torch.Tensor, group: Group, padding_idx: int | None = None
) -> torch.Tensor:
    """Look up the ids this rank owns; the rest contribute zeros. The result is a partial sum.

    The out-of-range mask is computed once from the original ids and applied to the output, so a
    legitimate local id 0 is never confused with a masked one (a Slapo bug).
    """
    start, end = vocab_range(weight.size(0), group)
    outside = (ids < start) | (ids >= end)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = padding_idx - start if padding_idx is not None and start <= padding_idx < end else None
    out = F.embedding(local_ids, weight, padding_idx=local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """megatron-core's vocabulary-parallel cross-entropy, over an explicit group, with ``ignore_index``.

    The maths is megatron-core's (the steps of its ``VocabParallelCrossEntropy``), with its fused
    variant's communication: one all-reduce of the row maxima, one of the target logits and sums
    of exponentials together. Not its functions themselves: ``vocab_parallel_cross_entropy``
    reduces over megatron-core's global tensor-parallel group (a schedule may be applied with
    another), and ``fused_vocab_parallel_cross_entropy`` returns bf16 gradients whatever the
    training dtype (fp32 parity needs fp32 ones).
    """

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE

        # logits: (N, V/n) this rank's vocabulary slice; target: (N,) global ids. megatron-core's
        # steps work in place on an fp32 copy: never on the caller's fp32 logits themselves.
        logits = logits.clone() if logits.dtype == torch.float32 else logits
        logits, logits_max = CE.calculate_logits_max(logits)
        distributed = group_size(group) > 1
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        start, end = vocab_range(logits.size(-1), group)
        outside, local_target, target_logit, sum_exp, exp = CE.calculate_predicted_logits(
            logits, target, logits_max, start, end
        )
        if distributed:
            both = torch.cat((target_logit, sum_exp))
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both.chunk(2)
        softmax, loss = CE.calculate_cross_entropy_loss(exp, target_logit, sum_exp)
        valid = target != ignore_index
        ctx.save_for_backward(softmax, local_target, outside, valid)
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE

        softmax, local_target, outside, valid = ctx.saved_tensors
        grad_2d, rows, update, grad = CE.prepare_gradient_calculation_operands(softmax, outside)
        grad = CE.calculate_gradients(grad_2d, rows, local_target, update, grad, grad_loss * valid.to(grad_loss.dtype))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy from vocabulary-partitioned ``logits`` (``..., V/n``).

    Equals ``F.cross_entropy(full_logits, target, reduction="none", ignore_index=...)`` computed on
    the gathered logits; ignored positions get loss 0. Computed in fp32.
    """
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.float().reshape(-1, logits.size(-1)), target.reshape(-1), group, ignore_index
    )
    return loss.view(shape)


class VocabParallelLMLoss:
    """Drop-in for an HF model's ``loss_function`` when its logits are vocabulary-partitioned.

    HF causal-LM and masked-LM heads compute their loss as ``self.loss_function(logits, labels,
    vocab_size=..., **kwargs)``; assigning an instance of this class to ``model.loss_function``
    keeps ``model(input_ids, labels=labels).loss`` working, with the same label shifting,
    ``ignore_index`` and ``num_items_in_batch`` semantics as HF's ``ForCausalLMLoss`` /
    ``ForMaskedLMLoss``.
    """

    def __init__(self, group: Group, causal: bool = True) -> None:
        self.group = group
        self.causal = causal

    def __deepcopy__(self, memo: dict) -> VocabParallelLMLoss:
        return self  # process groups are shared handles, not values

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.causal and shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        elif shift_labels is None:
            shift_labels = labels
        shift_labels = shift_labels.to(logits.device)
        losses = vocab_parallel_cross_entropy(logits, shift_labels, self.group, ignore_index)
        if num_items_in_batch is None:
            return losses.sum() / (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(losses.device)
        return losses.sum() / num_items_in_batch
