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
import torch.nn.functional as F

from megatron_slapo.kernels.cross_entropy import chunked_cross_entropy
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


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token fp32 cross-entropy from vocabulary-partitioned ``logits`` (``..., V/n``).

    Equals ``F.cross_entropy(full_logits.float(), target, reduction="none", ignore_index=...)`` on
    the gathered logits; ignored positions, and targets outside the vocabulary (BERT's -1 for
    unmasked tokens), get loss 0. fp32 logits of the whole vocabulary take
    torch's own kernel (the fastest here, and its saved log-softmax is no larger than the logits).
    Other logits go through :func:`~megatron_slapo.kernels.cross_entropy.chunked_cross_entropy`,
    the maths and the two all-reduces of megatron-core's ``VocabParallelCrossEntropy`` without
    its fp32 copy and fp32 softmax of the whole ``b x s x V/n`` logits (its
    ``fused_vocab_parallel_cross_entropy`` is leaner, but returns bf16 gradients whatever the
    training dtype, and both reduce over megatron-core's global group, not the schedule's).
    """
    if group_size(group) == 1 and logits.dtype == torch.float32:
        vocab = logits.size(-1)
        known = target.masked_fill((target < 0) | (target >= vocab), ignore_index)
        loss = F.cross_entropy(
            logits.reshape(-1, vocab), known.reshape(-1), reduction="none", ignore_index=ignore_index
        )
        return loss.view(target.shape)
    return chunked_cross_entropy(logits, target, group, ignore_index, vocab_range(logits.size(-1), group)[0])


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
            vocab = logits.size(-1) * group_size(self.group)
            counted = (shift_labels != ignore_index) & (shift_labels >= 0) & (shift_labels < vocab)  # as the losses
            return losses.sum() / counted.sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(losses.device)
        return losses.sum() / num_items_in_batch
