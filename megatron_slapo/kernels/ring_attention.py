"""Causal attention over a sequence split between context-parallel ranks (Megatron's ``--cp-comm-type``).

Each rank holds the queries, keys and values of its two chunks of the sequence
(:class:`~megatron_slapo.parallel.context.ContextParallel`) and must see every earlier key. Two
ways to bring them, both with the backward written out (:class:`_ContextAttention`):

- ``p2p``, the ring: the key/value block goes round the ranks, sent to the next one while this
  one computes with it (``batch_isend_irecv``: the transfer overlaps the block's compute where the
  backend runs it asynchronously); after ``C - 1`` hops every rank has seen every block. The
  backward sends the blocks round again, each with the gradient of its keys and values summed so
  far, which arrives back at its owner after ``C`` hops.
- ``allgather``: every rank gathers all blocks at once (again in the backward, rather than keeping
  ``C`` blocks alive in between), and the blocks' gradients are reduce-scattered to their owners.

Each block is merged with the online-softmax rescaling (``kernels/attention_blocks.py``, which
says why not SDPA). Both visit the blocks in the same order, so dropout draws the same masks
either way, and the backward draws them again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_slapo.kernels.attention_blocks import FULL, SKIP, Accumulator, BlockGrad, ChunkMasks, Dropout, summed
from megatron_slapo.parallel.collectives import _all_gather_single, _reduce_scatter_single
from megatron_slapo.parallel.context import ContextParallel


def _send_on(tensor: torch.Tensor, cp: ContextParallel) -> tuple[torch.Tensor, list]:
    """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new buffer."""
    buffer = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, cp.peer(1), cp.group), dist.P2POp(dist.irecv, buffer, cp.peer(-1), cp.group)]
    return buffer, dist.batch_isend_irecv(ops)


def _arrived(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
    buffer, works = pending
    for work in works:
        work.wait()
    return buffer


def _blocks(kv: torch.Tensor, cp: ContextParallel) -> Iterator[tuple[int, torch.Tensor]]:
    """Every rank's ``[2, ...]`` key/value block with its owner, this rank's first, then the ring's
    order: the previous rank's, the one before, ... (the transfer runs while the caller computes)."""
    if cp.comm == "allgather" and cp.size > 1:
        everything = kv.new_empty((cp.size * kv.size(0), *kv.shape[1:]))  # gloo takes the blocks end to end
        _all_gather_single(everything, kv, cp.group)
        everything = everything.view(cp.size, *kv.shape)
        for step in range(cp.size):
            owner = (cp.rank - step) % cp.size
            yield owner, everything[owner]
        return
    block = kv
    for step in range(cp.size):
        pending = _send_on(block, cp) if step < cp.size - 1 else None
        yield (cp.rank - step) % cp.size, block
        if pending is not None:
            block = _arrived(pending)


# Queries are taken this many at a time: a block's scores and probabilities (and in the backward
# their gradients) are ``rows x chunk`` per head, in fp32, however long the chunks grow.
TILE_ROWS = 512


def _tiles(start: int, end: int) -> list[slice]:
    """The query tiles of tokens ``start`` to ``end`` (one chunk)."""
    return [slice(first, min(first + TILE_ROWS, end)) for first in range(start, end, TILE_ROWS)]


def _rank_tiles(length: int) -> list[slice]:
    """The query tiles of a rank's ``length`` tokens, its two chunks' in order."""
    return _tiles(0, length // 2) + _tiles(length // 2, length)


def _pairs(cp: ContextParallel, owner: int, masks: ChunkMasks,
           device: torch.device) -> Iterator[tuple[slice, slice, torch.Tensor | str]]:  # fmt: skip
    """This rank's query tiles against ``owner``'s key chunks: the tile's token slice, the chunk's,
    and the mask between them, for the pairs where some query sees some key."""
    c = masks.chunk
    for a, query_chunk in enumerate(cp.chunks()):
        for b, key_chunk in enumerate(cp.chunks(owner)):
            kind = masks.between(query_chunk, key_chunk)
            if kind == SKIP:
                continue
            for rows in _tiles(a * c, (a + 1) * c):
                within = slice(rows.start - a * c, rows.stop - a * c)
                yield rows, slice(b * c, (b + 1) * c), kind if kind == FULL else masks.tile(query_chunk, key_chunk,
                                                                                            within, device)  # fmt: skip


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values as one block to send, ``[2, batch, kv_heads, 1, tokens, dim]``; the narrower
    (DeepSeek's latent attention has values narrower than keys) padded to the other's width."""
    width = max(k.size(-1), v.size(-1))
    k, v = (torch.nn.functional.pad(t, (0, width - t.size(-1))) for t in (k, v))
    return torch.stack([k, v]).unsqueeze(3)


def _unpack(kv: torch.Tensor, key_dim: int, value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv.squeeze(3).unbind(0)
    return k[..., :key_dim], v[..., :value_dim]


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, scale: float,
                dropout: float, window: int | None) -> torch.Tensor:  # fmt: skip
        batch, heads, length, dim = q.shape
        kv_heads, value_dim = k.size(1), v.size(-1)
        groups = q.view(batch, kv_heads, heads // kv_heads, length, dim)
        kv = _pack(k, v)  # [2, batch, kv_heads, 1, length, dim]
        masks, drop = ChunkMasks(length // 2, window), Dropout(dropout)
        drop.start(q.device)
        sums = {rows.start: Accumulator.empty(groups[..., rows, :], value_dim) for rows in _rank_tiles(length)}
        for owner, block in _blocks(kv, cp):
            for rows, cols, mask in _pairs(cp, owner, masks, q.device):
                sums[rows.start].add(groups[..., rows, :], block[0][..., cols, :dim], block[1][..., cols, :value_dim],
                                     scale, mask, drop)  # fmt: skip
        outs, lses = zip(*(sums[start].result(q.dtype) for start in sorted(sums)), strict=True)
        out = torch.cat(outs, dim=-2).view(batch, heads, length, value_dim)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=-1))
        ctx.cp, ctx.scale, ctx.masks, ctx.drop = cp, scale, masks, drop
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        cp, scale, masks, drop = ctx.cp, ctx.scale, ctx.masks, ctx.drop
        batch, heads, length, dim = q.shape
        kv_heads, value_dim = k.size(1), v.size(-1)
        shape = (batch, kv_heads, heads // kv_heads, length)
        groups, grad = q.view(*shape, dim), grad_out.contiguous().view(*shape, value_dim)
        dtype = summed(q.dtype)
        delta = (grad.to(dtype) * out.view(grad.shape).to(dtype)).sum(-1)
        dq = torch.zeros(groups.shape, dtype=dtype, device=q.device)
        tiles = {rows.start: BlockGrad(groups[..., rows, :], grad[..., rows, :], lse[..., rows], delta[..., rows],
                                       dq[..., rows, :]) for rows in _rank_tiles(length)}  # fmt: skip
        kv = _pack(k, v)
        dkv = torch.zeros(kv.shape, dtype=dtype, device=q.device)  # the block's gradient, summed in fp32 (or fp64)
        grads = {}  # all_gather: each owner's, reduce-scattered at the end
        with drop.replaying(q.device):
            for owner, block in _blocks(kv, cp):
                if cp.comm == "allgather" and cp.size > 1:
                    dkv = grads.setdefault(owner, torch.zeros_like(dkv))
                for rows, cols, mask in _pairs(cp, owner, masks, q.device):
                    dk, dv = tiles[rows.start](block[0][..., cols, :dim], block[1][..., cols, :value_dim], scale, mask,
                                               drop)  # fmt: skip
                    dkv[0][..., cols, :dim] += dk
                    dkv[1][..., cols, :value_dim] += dv
                if cp.comm == "p2p" and cp.size > 1:  # on to the rank that holds this block next
                    dkv = _arrived(_send_on(dkv, cp))
        if grads:
            dkv = torch.empty_like(dkv)
            _reduce_scatter_single(dkv, torch.cat([grads[owner] for owner in range(cp.size)]), cp.group)
        dk, dv = _unpack(dkv, dim, value_dim)
        return dq.to(q.dtype).view(q.shape), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


MetaObserver = Callable[[str, ContextParallel, torch.Tensor, torch.Tensor], None]
_meta_observers: list[MetaObserver] = []


@contextlib.contextmanager
def observing_meta(observer: MetaObserver) -> Iterator[None]:
    """While open, ``observer(phase, cp, k, v)`` is called each time the ring runs on the meta
    device, ``phase`` ``"forward"`` (again when recomputed) or ``"backward"``: where the real one
    would exchange ``k`` and ``v`` between ``cp``'s ranks (``tools/explain.py`` counts those bytes:
    ``estimates/context_estimate.py``)."""
    _meta_observers.append(observer)
    try:
        yield
    finally:
        _meta_observers.remove(observer)


class _OnMeta(torch.autograd.Function):
    """The ring on the meta device, where nothing is exchanged: it saves what
    :class:`_ContextAttention` saves (q, k, v, the output and the log-sum-exp per row), runs its
    block products (the same matmuls, which FLOP counters see), reaches q, k and v backward and
    tells the :func:`observing_meta` observers, so a meta pass (``tools/explain.py``) measures
    what the ring keeps, computes and moves."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                window: int | None) -> torch.Tensor:  # fmt: skip
        batch, heads, length, _ = q.shape
        masks = ChunkMasks(length // 2, window)
        ctx.pairs = [(rows, cols) for owner in range(cp.size) for rows, cols, _ in _pairs(cp, owner, masks, q.device)]
        groups, keys, values = _grouped(q, k, v)
        for rows, cols in ctx.pairs:  # each block's q kᵀ, then its probabilities times v
            torch.matmul(torch.matmul(groups[..., rows, :], keys[..., cols, :].transpose(-1, -2)), values[..., cols, :])
        out = q.new_empty((batch, heads, length, v.size(-1)))
        ctx.save_for_backward(q, k, v, out, q.new_empty((batch, heads, length), dtype=summed(q.dtype)))
        ctx.cp = cp
        for observe in _meta_observers:
            observe("forward", cp, k, v)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple:
        q, k, v, _, _ = ctx.saved_tensors
        groups, keys, values = _grouped(q, k, v)
        grad = grad_out.reshape(*groups.shape[:-1], v.size(-1))
        for rows, cols in ctx.pairs:  # the scores again, dv, dp, dq, dk
            scores = torch.matmul(groups[..., rows, :], keys[..., cols, :].transpose(-1, -2))
            torch.matmul(scores.transpose(-1, -2), grad[..., rows, :])
            ds = torch.matmul(grad[..., rows, :], values[..., cols, :].transpose(-1, -2))
            torch.matmul(ds, keys[..., cols, :])
            torch.matmul(ds.transpose(-1, -2), groups[..., rows, :])
        for observe in _meta_observers:
            observe("backward", ctx.cp, k, v)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries as ``[batch, kv_heads, group, tokens, dim]``, keys and values with a group axis of 1."""
    batch, heads, length, dim = q.shape
    return q.view(batch, k.size(1), heads // k.size(1), length, dim), k.unsqueeze(2), v.unsqueeze(2)


def context_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: ContextParallel, *,
                      scale: float, dropout: float = 0.0, window: int | None = None) -> torch.Tensor:  # fmt: skip
    """Causal attention of this rank's ``[batch, heads, tokens, dim]`` queries over the whole
    sequence's keys and values, of which this rank holds its tokens' (``kv_heads`` may divide
    ``heads``: grouped-query attention). ``window``: sliding-window attention (keys fewer than
    ``window`` tokens back). Returns ``[batch, heads, tokens, dim]``."""
    if query.size(2) % 2:
        raise ValueError(f"context-parallel attention takes two equal chunks per rank, not {query.size(2)} tokens")
    if query.size(1) % key.size(1):
        raise ValueError(f"{query.size(1)} query heads do not share {key.size(1)} key/value heads evenly")
    if query.device.type == "meta":  # a trace's shape propagation, explain's meta pass: nothing to exchange
        return _OnMeta.apply(query.contiguous(), key.contiguous(), value.contiguous(), cp, window)
    # The kernel picks its own precisions (fp32 scores and sums for 16-bit inputs); autocast, which
    # the backward would not see, stays out of it so both compute alike.
    with torch.autocast(query.device.type, enabled=False):
        return _ContextAttention.apply(query.contiguous(), key.contiguous(), value.contiguous(), cp, scale, dropout,
                                       window)  # fmt: skip
