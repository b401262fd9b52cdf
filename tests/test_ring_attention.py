"""The context-parallel attention kernel in one process (one rank holding the whole sequence):
outputs and gradients against SDPA with the same mask, grouped-query heads, a sliding window,
values narrower than keys; its dropout masks drawn again, the same, by the backward."""

import pytest
import torch
import torch.nn.functional as F

from megatron_slapo.kernels import ring_attention
from megatron_slapo.kernels.attention_blocks import FULL, PARTIAL, SKIP, ChunkMasks
from megatron_slapo.kernels.ring_attention import context_attention
from megatron_slapo.parallel.context import ContextParallel

ALONE = ContextParallel(group=None, rank=0, size=1)


def _allowed(seq: int, window: int | None) -> torch.Tensor:
    gap = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    return (gap >= 0) & (gap < (window or seq))


@pytest.mark.parametrize("tile_rows", [512, 3])  # a chunk in one tile, or in tiles of 3, 3 and 2 queries
@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("value_dim", [8, 6])
def test_outputs_and_gradients_match_sdpa(window, value_dim, tile_rows, monkeypatch):
    monkeypatch.setattr(ring_attention, "TILE_ROWS", tile_rows)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, requires_grad=True)  # 4 heads sharing 2 key/value heads
    k = torch.randn(2, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 16, value_dim, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 4, 16, value_dim, dtype=torch.float64)
    out = context_attention(q, k, v, ALONE, scale=0.3, window=window)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(16, window), scale=0.3, enable_gqa=True)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    assert (out - expected).abs().max() < 1e-12
    for a, b in zip(mine, theirs, strict=True):
        assert (a - b).abs().max() < 1e-12


def test_dropout_masks_are_drawn_again_by_the_backward(monkeypatch):
    """gradcheck holds only if the backward applies the very masks the forward drew (the seed is
    set before each forward; the backward restores the generator state on its own)."""
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    monkeypatch.setattr(ring_attention, "TILE_ROWS", 3)  # several tiles: masks drawn per tile, in the same order

    def attend(q, k, v):
        torch.manual_seed(7)
        return context_attention(q, k, v, ALONE, scale=0.5, dropout=0.3)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    torch.manual_seed(7)
    dropped = attend(q, k, v)
    assert not torch.allclose(dropped, context_attention(q, k, v, ALONE, scale=0.5))  # dropout did act
    state = torch.get_rng_state()
    dropped.sum().backward()
    assert torch.equal(state, torch.get_rng_state())  # the backward's replay left the generator as it was


def test_chunk_masks_skip_later_keys_and_keep_the_window():
    cpu, masks = torch.device("cpu"), ChunkMasks(chunk=4)
    assert masks.between(2, 3) == SKIP  # a later chunk: nothing to see
    assert masks.between(3, 1) == FULL
    assert masks.between(1, 1) == PARTIAL and torch.equal(masks.tile(1, 1, slice(0, 4), cpu), _allowed(4, None))
    assert torch.equal(masks.tile(1, 1, slice(1, 3), cpu), _allowed(4, None)[1:3])  # a tile of its queries
    windowed = ChunkMasks(chunk=4, window=4)
    assert windowed.between(3, 1) == SKIP  # 5 to 11 tokens back: out of the window
    assert windowed.between(2, 1) == PARTIAL and windowed.tile(2, 1, slice(0, 4), cpu).sum() == 6  # the window's reach


def test_the_load_balanced_layout():
    ranks = [ContextParallel(None, r, 4) for r in range(4)]
    assert [cp.chunks() for cp in ranks] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    tokens = torch.arange(16).expand(2, 16)
    assert ranks[1].local(tokens).tolist() == [[2, 3, 12, 13]] * 2
    assert sorted(torch.cat([cp.token_index(16) for cp in ranks]).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="does not cut into 2 x 4 equal chunks"):
        ranks[0].token_index(12)


def test_16_bit_inputs_sum_in_fp32_under_autocast_too():
    """bf16 queries, keys and values (as a --bf16 run's projections give them, autocast on): the
    scores and sums are fp32 in the forward and in its recomputation, so the result is fp32's
    rounded once to bf16, and the gradients are the fp32 ones to bf16's precision."""
    torch.manual_seed(0)
    full = [torch.randn(1, 4, 16, 8, requires_grad=True) for _ in range(3)]
    half = [t.detach().bfloat16().requires_grad_() for t in full]
    grad = torch.randn(1, 4, 16, 8)
    expected = context_attention(*full, ALONE, scale=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = context_attention(*half, ALONE, scale=1.0)
    assert out.dtype == torch.bfloat16 and (out.float() - expected).abs().max() < 2e-2
    for got, want in zip(torch.autograd.grad(out, half, grad.bfloat16()), torch.autograd.grad(expected, full, grad),
                         strict=True):  # fmt: skip
        assert (got.float() - want).abs().max() < 5e-2 * want.abs().max()
