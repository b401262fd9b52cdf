"""A packed q|k|v with grouped-query attention (Phi-3's ``qkv_proj``: rows ``[q: H*d | k: KV*d | v: KV*d]``)
column-parallel with ``stride=(H, KV, KV)``: each rank holds its own heads of q, k and v, and the
attention matches one process (``Verify``: the output and every gradient)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megatron_slapo as ms
from megatron_slapo.kernels.qkv import FusedQKV
from megatron_slapo.plans.styles import ColumnParallel, RowParallel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 4, 2
STRIDE = (HEADS, KV_HEADS, KV_HEADS)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over this rank's heads (counted from the features), k and v shared by groups of q heads."""
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)


class PackedAttention(nn.Module):
    """q|k|v in one Linear sliced by widths in the ratio H:KV:KV of the rows this rank holds."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qkv_proj(x)
        kv = y.size(-1) * KV_HEADS // (HEADS + 2 * KV_HEADS)
        return self.o_proj(_attention(*y.split([y.size(-1) - 2 * kv, kv, kv], dim=-1)))


class SplitAttention(nn.Module):
    """The same attention with separate q, k and v layers, to be fused into a :class:`FusedQKV`."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(HIDDEN, HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.k, self.v = (nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(_attention(self.q(x), self.k(x), self.v(x)))


def _inputs() -> torch.Tensor:
    return torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(0))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_packed_gqa_projection_with_a_tuple_stride_matches_one_process(group, world, device):
    with torch.device(device):
        torch.manual_seed(0)
        sch = ms.create_schedule(PackedAttention(), group)
    with ms.Verify(sch, [_inputs()], seed=5) as verify:
        ColumnParallel(stride=STRIDE).apply(sch["qkv_proj"])
        RowParallel().apply(sch["o_proj"])
    assert {"grad of qkv_proj.weight", "grad of qkv_proj.bias"} <= set(verify.report.grads)
    assert not verify.report.unchecked and not verify.report.failures
    rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    assert f"shard weight axis 0, stride (8, 4, 4): ({rows}, {HIDDEN}) -> ({rows // world}, {HIDDEN})" in sch.explain()


@pytest.mark.world_sizes(2, 4)
def test_a_fused_qkv_of_narrower_k_v_shards_with_a_tuple_stride(group):
    sch = ms.create_schedule(SplitAttention(), group)
    with ms.Verify(sch, [_inputs()], seed=5) as verify:
        sch.trace(example_inputs=_inputs())
        fused = FusedQKV.from_linears(sch["q"].mod, sch["k"].mod, sch["v"].mod, head_dim=HEAD_DIM)
        sch.replace(fused, target_ops=sch.find(r"^[qkv]$"), name="qkv")
        ColumnParallel(stride=STRIDE).apply(sch["qkv.proj"])
        RowParallel().apply(sch["o"])
    assert {"grad of qkv.proj.weight", "grad of qkv.proj.bias"} <= set(verify.report.grads)
    assert not verify.report.unchecked and not verify.report.failures


def test_a_tuple_stride_whose_blocks_do_not_split_over_the_ranks_is_refused(group):
    sch = ms.create_schedule(nn.Sequential(nn.Linear(4, 12)), group)
    with pytest.raises(ms.SchedulingError, match=r"stride \(2, 1, 1\) cuts its 12 into blocks of \[6, 3, 3\], "
                                                 r"not all divisible by the group size 2"):  # fmt: skip
        sch["0"].shard("weight", axis=0, stride=(2, 1, 1))
    sch["0"].shard("weight", axis=0, stride=(2, 1, 1, 2))  # blocks of 4, 2, 2, 4
    with pytest.raises(ms.SchedulingError, match=r"stride \(2, 1, 1, 2\): gathering would interleave"):
        sch["0"].sync("fwd_post", "all_gather")
