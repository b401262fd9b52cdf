"""Cross-entropy that never holds fp32 logits whole: computed chunk by chunk of tokens, its gradient
written during the forward into one buffer of the logits' own dtype.

The logits of a GPT step are the largest activation there is (``b x s x V``: 411 MB in fp32 for
GPT-2 at batch 4 and sequence 512). torch's ``F.cross_entropy`` keeps an fp32 log-softmax of them
for the backward, and megatron-core's vocabulary-parallel steps keep an fp32 copy and an fp32
softmax; with bf16 logits, both first make an fp32 copy. Here each chunk of tokens is upcast on
its own, and the forward leaves behind only ``softmax - one_hot(target)``, the gradient with
respect to the logits up to the per-token factor that arrives in the backward; it is stored in the
logits' dtype, so nothing of fp32 size ``b x s x V`` is ever allocated.

Where the whole vocabulary is on this rank, a chunk takes one pass: maximum, target logit, sum of
exponentials and gradient together (on a GPU compiled into one kernel, in chunks of 512 MiB).
Vocabulary-parallel logits (``V/t`` columns per rank) take three passes around the same two
all-reduces as megatron-core's: the per-token maximum, then the target logits and sums of
exponentials together.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_slapo.kernels.compiled import compiler_problem
from megatron_slapo.parallel.collectives import Group, group_size

CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk of logits, eager: small enough to stay in the way of nothing
COMPILED_CHUNK_BYTES = 512 * 2**20  # compiled (no fp32 chunk is allocated): few chunks, few kernel launches


def chunks(rows: int, columns: int, limit: int | None = None) -> list[slice]:
    """Row slices of a ``rows x columns`` fp32 matrix, each about ``limit`` bytes (:data:`CHUNK_BYTES`)."""
    step = max(1, (limit or CHUNK_BYTES) // (4 * columns))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _loss_and_grad(logits: torch.Tensor, local: torch.Tensor, inside: torch.Tensor):
    """One chunk of whole-vocabulary logits in one pass: each row's loss (the target's; 0's where
    the target is not in these columns, masked by the caller) and ``softmax - one_hot`` in the
    logits' dtype, computed in fp32. Eager: in place on one fp32 copy of the chunk."""
    x = logits.float()
    x = x - x.amax(dim=-1, keepdim=True)
    target_logit = x.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0.0)
    sum_exp = x.exp_().sum(dim=-1)
    x.div_(sum_exp[:, None]).scatter_add_(1, local[:, None], -inside[:, None].float())
    return sum_exp.log() - target_logit, x.to(logits.dtype)


def _loss_and_grad_fusable(logits: torch.Tensor, local: torch.Tensor, inside: torch.Tensor):
    """:func:`_loss_and_grad` in the form inductor compiles to one kernel that reads the chunk and
    writes the gradient in the logits' dtype, with fp32 buffers of one value a row only: the
    softmax from the log-sum-exp (not exponentials kept for a division), the one-hot by comparison
    (an in-place scatter would stay a kernel of its own on an fp32 chunk). Slow eager: compile it."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0.0)
    p = (x - lse[:, None]).exp()
    target = (torch.arange(logits.size(1), device=logits.device) == local[:, None]) & inside[:, None]
    return lse - target_logit, torch.where(target, p - 1, p).to(logits.dtype)


@functools.cache
def _one_pass(device_type: str) -> tuple[Callable, int | None]:
    """The one-pass function for a device and its chunk size: compiled on a GPU where inductor
    builds (a kernel per step of the maths, hundreds a step, cost more there than the maths);
    eager, in place, elsewhere. The number of rows may change (the last chunk, evaluation):
    torch.compile's automatic dynamic shapes then recompile once with the rows symbolic."""
    if device_type == "cuda" and _compiles():
        return torch.compile(_loss_and_grad_fusable), COMPILED_CHUNK_BYTES
    return _loss_and_grad, None  # None: CHUNK_BYTES


def _compiles() -> bool:
    """Whether inductor builds here. A run that never asked for ``--compile`` keeps the eager loss,
    with a warning, when the probe fails for any other reason than a missing compiler (which
    :func:`compiler_problem` raises, for ``--compile`` and the tests to fail on)."""
    try:
        return compiler_problem() is None
    except Exception as e:  # noqa: BLE001 (the loss is exact either way; only its speed differs)
        warnings.warn(f"the compiled cross-entropy is off ({type(e).__name__}: {e}); the eager one runs", stacklevel=2)
        return False


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, ignore_index: int,
                vocab_start: int) -> torch.Tensor:  # fmt: skip
        rows, columns = logits.shape
        distributed = group_size(group) > 1
        local = target - vocab_start
        inside = (local >= 0) & (local < columns)
        local = local.masked_fill(~inside, 0)
        valid = (target != ignore_index) & (target >= 0) & (target < columns * group_size(group))
        if not distributed and ctx.needs_input_grad[0]:  # the whole vocabulary here: one pass a chunk
            one_pass, limit = _one_pass(logits.device.type)
            grad, loss = torch.empty_like(logits), torch.empty(rows, dtype=torch.float32, device=logits.device)
            for part in chunks(rows, columns, limit):
                loss[part], grad[part] = one_pass(logits[part], local[part], inside[part])
            ctx.save_for_backward(grad, valid)
            return loss.masked_fill_(~valid, 0.0)
        parts = chunks(rows, columns)
        logits_max = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for part in parts:
            logits_max[part] = logits[part].float().amax(dim=-1)
        if distributed:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty(2, rows, dtype=torch.float32, device=logits.device)  # target logit, sum of exp
        for part in parts:
            shifted = logits[part].float() - logits_max[part, None]
            sums[0, part] = shifted.gather(1, local[part, None]).squeeze(1).masked_fill(~inside[part], 0.0)
            sums[1, part] = shifted.exp_().sum(dim=-1)
        if distributed:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums
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
