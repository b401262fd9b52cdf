"""Cross-entropy that never holds fp32 logits whole: computed chunk by chunk of tokens, its gradient
written during the forward into one buffer of the logits' own dtype.

The logits of a GPT step are the largest activation there is (``b x s x V``: 411 MB in fp32 for
GPT-2 at batch 4 and sequence 512). torch's ``F.cross_entropy`` keeps an fp32 log-softmax of them
for the backward, and megatron-core's vocabulary-parallel steps keep an fp32 copy and an fp32
softmax; with bf16 logits, both first make an fp32 copy. Here each chunk of tokens is upcast on
its own, and the forward leaves behind only ``softmax - one_hot(target)``, the gradient with
respect to the logits up to the per-token factor that arrives in the backward; it is stored in the
logits' dtype, so nothing of fp32 size ``b x s x V`` is ever allocated.

Vocabulary-parallel logits (``V/t`` columns per rank) take the same two all-reduces as
megatron-core's: the per-token maximum, then the target logits and sums of exponentials together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_slapo.parallel.collectives import Group, group_size

CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk of logits: small enough to stay out of the way


def chunks(rows: int, columns: int) -> list[slice]:
    """Row slices of a ``rows x columns`` fp32 matrix, each about :data:`CHUNK_BYTES`."""
    step = max(1, CHUNK_BYTES // (4 * columns))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int,
                vocab_start: int) -> torch.Tensor:  # fmt: skip
        rows, columns = logits.shape
        parts = chunks(rows, columns)
        distributed = group_size(group) > 1
        logits_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for part in parts:
            logits_max[part] = logits[part].float().amax(dim=-1)
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        local = target - vocab_start
        inside = (local >= 0) & (local < columns)
        local = local.masked_fill(~inside, 0)
        sums = torch.empty(2, rows, dtype=torch.float32, device=logits.device)  # target logit, sum of exp
        for part in parts:
            shifted = logits[part].float() - logits_max[part, None]
            sums[0, part] = shifted.gather(1, local[part, None]).squeeze(1).masked_fill(~inside[part], 0.0)
            sums[1, part] = shifted.exp_().sum(dim=-1)
        if distributed:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums
        valid = (target != ignore_index) & (target >= 0) & (target < columns * group_size(group))
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        if not ctx.needs_input_grad[0]:  # evaluation: no gradient to prepare
            return loss
        # softmax - one_hot, in fp32 per chunk (the exponentials again: a bf16 copy of them would
        # lose the gradient of confident predictions, 1 - p), stored in the logits' dtype
        grad = torch.empty_like(logits)
        for part in parts:
            probs = (logits[part].float() - logits_max[part, None]).exp_().div_(sum_exp[part, None])
            probs.scatter_add_(1, local[part, None], -inside[part, None].float())
            grad[part] = probs
        ctx.save_for_backward(grad, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad, valid = ctx.saved_tensors  # used once: scaled in place (no retain_graph through the loss)
        grad *= (grad_loss * valid).to(grad.dtype)[:, None]
        return grad, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group = None, ignore_index: int = -100,
                          vocab_start: int = 0) -> torch.Tensor:  # fmt: skip
    """Per-token fp32 cross-entropy of ``logits`` (``..., V``, or this rank's ``V/t`` columns from
    ``vocab_start`` when ``group`` splits the vocabulary); ignored positions and targets outside
    the vocabulary get loss 0."""
    flat = logits.reshape(-1, logits.size(-1))
    loss = _ChunkedCrossEntropy.apply(flat, target.reshape(-1), group, ignore_index, vocab_start)
    return loss.view(target.shape)
