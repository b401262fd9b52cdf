"""Rewrites under tensor parallelism: fused q|k|v projections and decomposed layers, sharded."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

import megatron_slapo as ms
from megatron_slapo.kernels.qkv import FusedQKV
from megatron_slapo.plans.styles import ColumnParallel, RowParallel
from tests.utils import tiny_gpt2_config

HIDDEN, HEAD_DIM = 32, 8


class Attention(nn.Module):
    """Multi-head self-attention whose reshapes count heads from the features (``-1``), so it runs
    on this rank's heads once q, k, v are column-parallel and ``out`` row-parallel."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, -1))


def _inputs():
    return torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(0))


def _fuse(sch):
    sch.trace(example_inputs=_inputs())
    fused = FusedQKV.from_linears(sch["q"].mod, sch["k"].mod, sch["v"].mod, head_dim=HEAD_DIM)
    sch.replace(fused, target_ops=sch.find(r"^[qkv]$"), name="qkv")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fused_qkv_column_parallel_matches_the_unsharded_attention(group, device):
    """Each rank splits its projection into its own heads of q, k and v (local sizes), and Verify
    compares the fused weight's gradient with the original q, k, v gradients."""
    with torch.device(device):
        torch.manual_seed(0)
        sch = ms.create_schedule(Attention(), group)
    with ms.Verify(sch, [_inputs()], seed=5) as verify:
        _fuse(sch)
        ColumnParallel(stride=3).apply(sch["qkv.proj"])
        RowParallel().apply(sch["out"])
    assert {"grad of qkv.proj.weight", "grad of qkv.proj.bias"} <= set(verify.report.grads)
    assert not verify.report.unchecked and not verify.report.failures


def test_a_fused_qkv_layout_mixing_q_k_v_is_refused_before_compute(group):
    with torch.device("meta"):
        sch = ms.create_schedule(Attention(), group)
    _fuse(sch)
    ColumnParallel(stride=1).apply(sch["qkv.proj"])  # rank 0 would hold all of q, rank 1 k and v
    with pytest.raises(ms.SchedulingError, match=r"\[qkv\] FusedQKV: sharding its projection with stride 1 over 2 "
                                                 r"ranks does not give each rank its own part of q, k and v"):  # fmt: skip
        ms.build(sch)


def test_decomposed_conv1d_layers_keep_megatron_placements(group):
    """A decomposed row-parallel Conv1D adds its bias once, after the all-reduce."""
    torch.manual_seed(0)
    mlp = GPT2MLP(4 * HIDDEN, tiny_gpt2_config()).eval()
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.1)  # nonzero biases (HF's Conv1D starts them at 0)
    sch = ms.create_schedule(mlp, group)
    with ms.Verify(sch, [_inputs()], seed=5) as verify:
        sch["c_fc"].decompose()
        sch["c_proj"].decompose()
        sch["c_fc"].shard("weight", axis=1)  # HF Conv1D stores W^T: axis 1 = outputs
        sch["c_fc"].shard("bias", axis=0)
        sch["c_fc"].sync("bwd_post", "all_reduce")
        sch["c_proj"].shard("weight", axis=0)
        sch["c_proj"].sync("fwd_post", "all_reduce")
    assert len(verify.report.grads) == 4 and not verify.report.failures
