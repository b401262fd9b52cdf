"""Causal attention one block of keys at a time, merged with the online-softmax rescaling.

Context parallelism gives each rank a part of the sequence and brings it the others' keys and
values block by block (``kernels/ring_attention.py``). Each block's contribution to
``softmax(q kᵀ) v`` is computed here and merged into running sums: the row maximum ``m``, the
softmax denominator ``l`` and the unnormalised output ``o`` (the rescaling of FlashAttention), so
no rank ever holds a ``seq x seq`` score matrix, only one ``chunk x chunk`` block at a time. The
backward recomputes each block's probabilities from the saved log-sum-exp (FlashAttention-2's
backward), so the forward saves only ``q, k, v``, the output and one number per row.

Why not SDPA: its public API returns no log-sum-exp, without which partial results cannot be
merged; torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``) takes
it from the private flash/efficient/cuDNN ops, which it dispatches for CUDA only. On GPUs torch's
would run, but it works on DTensors of buffers it shards itself, inside a context manager that
patches SDPA for the whole step, and takes no mask (sliding windows); one kernel on both machines keeps a CPU run
and a GPU run the same computation. The blocks are plain matrix products, which run wherever
torch does.

Shapes: queries ``[batch, kv_heads, group, chunk, dim]`` (grouped-query attention: ``group`` query
heads per key/value head), keys and values ``[batch, kv_heads, 1, chunk, dim]``. Positions are
whole chunks of the sequence (``chunk`` tokens each); which key chunk a query chunk may see, and
how much of it, depends only on the distance between them (:class:`ChunkMasks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def summed(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores and sums are kept in: fp32 for 16-bit and fp32 inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


# How two chunks of the sequence relate, as ChunkMasks.between says
FULL = "full"  # every query of the one sees every key of the other
SKIP = "skip"  # none does
PARTIAL = "partial"  # some queries see some keys: the mask is built for each tile of queries


@dataclass(frozen=True)
class ChunkMasks:
    """Which keys each query sees between two chunks of ``chunk`` tokens: causal, and within
    ``window`` tokens back when given (sliding-window attention: ``0 <= q - k < window``). Nothing
    ``chunk x chunk`` is kept: a partial block's mask is built per tile of queries, when used."""

    chunk: int
    window: int | None = None

    def _reach(self, distance: int) -> int:
        return self.window if self.window is not None else distance * self.chunk + self.chunk  # beyond any gap

    def between(self, query_chunk: int, key_chunk: int) -> str:
        """:data:`FULL`, :data:`SKIP` or :data:`PARTIAL`, for chunks ``query_chunk`` and ``key_chunk``."""
        distance, c = query_chunk - key_chunk, self.chunk
        nearest, farthest = distance * c - (c - 1), distance * c + (c - 1)  # q - k over the block
        reach = self._reach(distance)
        if farthest < 0 or nearest >= reach:
            return SKIP
        return FULL if nearest >= 0 and farthest < reach else PARTIAL

    def tile(self, query_chunk: int, key_chunk: int, rows: slice, device: torch.device) -> torch.Tensor:
        """The boolean mask (True: attend) of queries ``rows`` of ``query_chunk`` (offsets within
        it) against every key of ``key_chunk``."""
        distance = query_chunk - key_chunk
        i, j = torch.arange(rows.start, rows.stop, device=device), torch.arange(self.chunk, device=device)
        gap = distance * self.chunk + i[:, None] - j[None, :]
        return (gap >= 0) & (gap < self._reach(distance))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | str) -> torch.Tensor:
    dtype = summed(q.dtype)  # 16-bit inputs: products summed in fp32, as SDPA's kernels do (no fp16 overflow)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    return scores if isinstance(mask, str) else scores.masked_fill(~mask, float("-inf"))


@dataclass
class Dropout:
    """Attention-probability dropout whose masks the backward draws again: the generator state is
    taken when the forward starts and restored (on a fork) when the backward starts, and both
    visit the blocks in the same order."""

    p: float
    state: torch.Tensor | None = None

    def start(self, device: torch.device) -> None:
        if self.p:
            self.state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    @contextlib.contextmanager
    def replaying(self, device: torch.device) -> Iterator[None]:
        """A context in which the generator replays the forward's masks (and is left as it was)."""
        if not self.p:
            yield
            return
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            if device.type == "cuda":
                torch.cuda.set_rng_state(self.state, device)
            else:
                torch.set_rng_state(self.state)
            yield

    def keep(self, like: torch.Tensor) -> torch.Tensor | None:
        """The kept probabilities' scale (``0`` or ``1 / (1 - p)``) for a block, or None without dropout."""
        if not self.p:
            return None
        return (torch.rand(like.shape, device=like.device) >= self.p).to(like.dtype) / (1.0 - self.p)


@dataclass
class Accumulator:
    """One tile of queries' running ``m``, ``l`` and ``o`` over the key blocks seen so far."""

    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the softmax denominator's usual name)

    @classmethod
    def empty(cls, q: torch.Tensor, value_dim: int) -> Accumulator:
        rows = q.shape[:-1]
        dtype = summed(q.dtype)
        return cls(torch.zeros((*rows, value_dim), dtype=dtype, device=q.device),
                   torch.full(rows, float("-inf"), dtype=dtype, device=q.device),
                   torch.zeros(rows, dtype=dtype, device=q.device))  # fmt: skip

    def add(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | str,
            dropout: Dropout) -> None:  # fmt: skip
        """Merge one key/value block into the sums."""
        scores = _scores(q, k, scale, mask)
        m = torch.maximum(self.m, scores.amax(-1))
        shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row with no key yet: nothing to rescale
        rescale = torch.exp(self.m - shift)
        p = torch.exp(scores - shift[..., None])
        self.l = self.l * rescale + p.sum(-1)
        keep = dropout.keep(p)
        kept = p if keep is None else p * keep
        self.o = self.o * rescale[..., None] + torch.matmul(kept.to(v.dtype), v).to(self.o.dtype)
        self.m = m

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output (in ``dtype``) and each row's log-sum-exp (for the backward)."""
        return (self.o / self.l[..., None]).to(dtype), self.m + torch.log(self.l)


@dataclass
class BlockGrad:
    """The backward of one tile of queries against one key/value block: adds to ``dq`` in place and
    returns the block's ``dk``, ``dv`` (summed over the query heads sharing each key head)."""

    q: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor  # rowsum(grad_out * out): the softmax backward's correction, once per row
    dq: torch.Tensor

    def __call__(self, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | str,
                 dropout: Dropout) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        p = torch.exp(_scores(self.q, k, scale, mask) - self.lse[..., None])
        keep = dropout.keep(p)
        kept = p if keep is None else p * keep
        dv = (
            torch.matmul(kept.to(self.grad_out.dtype).transpose(-1, -2), self.grad_out).to(p.dtype).sum(2, keepdim=True)
        )
        dp = torch.matmul(self.grad_out.to(p.dtype), v.to(p.dtype).transpose(-1, -2))
        if keep is not None:
            dp = dp * keep
        ds = (p * (dp - self.delta[..., None]) * scale).to(self.q.dtype)
        self.dq += torch.matmul(ds, k).to(self.dq.dtype)
        dk = torch.matmul(ds.transpose(-1, -2), self.q).to(p.dtype).sum(2, keepdim=True)
        return dk, dv
