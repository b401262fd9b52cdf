"""shard + sync on single layers (nn.Linear, HF Conv1D, nn.Embedding, both axes) vs one device.

Each case builds the same layer twice from one seed, schedules one copy, and compares the local
forward output and every local gradient with the matching slice of the unsharded layer's.
"""

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import megatron_slapo as ms
from megatron_slapo import create_schedule
from tests.utils import expected_shard, max_diff

IN, OUT, B, S = 8, 12, 2, 4
TOL = 1e-5


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.Linear(IN, OUT) if kind == "linear" else Conv1D(OUT, IN)
    with torch.no_grad():
        layer.bias.normal_()  # nonzero, so a bias added once per rank would show
    return layer


# (output axis, input axis) of the weight: Conv1D stores it transposed.
AXES = {"linear": (0, 1), "conv1d": (1, 0)}


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_column_parallel(group, rank, world, kind):
    out_axis, _ = AXES[kind]
    ref, layer = make(kind), make(kind)
    sch = create_schedule(layer, group)
    sch.shard("weight", axis=out_axis)
    sch.shard("bias", axis=0)
    sch.sync("bwd_post", "all_reduce")

    x = torch.randn(B, S, IN, generator=torch.Generator().manual_seed(1))
    g = torch.randn(B, S, OUT, generator=torch.Generator().manual_seed(2))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g).sum().backward()
    y = layer(x_tp)
    (y * g.chunk(world, -1)[rank]).sum().backward()

    assert max_diff(y, y_ref.chunk(world, -1)[rank]) < TOL
    assert max_diff(layer.weight.grad, expected_shard(ref.weight.grad, out_axis, rank, world)) < TOL
    assert max_diff(layer.bias.grad, expected_shard(ref.bias.grad, 0, rank, world)) < TOL
    assert max_diff(x_tp.grad, x_ref.grad) < TOL  # needs the bwd_post all-reduce


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_row_parallel_adds_bias_after_reduction(group, rank, world, kind):
    _, in_axis = AXES[kind]
    ref, layer = make(kind), make(kind)
    sch = create_schedule(layer, group)
    sch.shard("weight", axis=in_axis)
    sch.sync("fwd_post", "all_reduce")

    x = torch.randn(B, S, IN, generator=torch.Generator().manual_seed(1))
    g = torch.randn(B, S, OUT, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_()
    x_tp = x.chunk(world, -1)[rank].clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * g).sum().backward()
    y = layer(x_tp)
    (y * g).sum().backward()

    assert max_diff(y, y_ref) < TOL
    assert max_diff(layer.weight.grad, expected_shard(ref.weight.grad, in_axis, rank, world)) < TOL
    assert max_diff(layer.bias.grad, ref.bias.grad) < TOL
    assert max_diff(x_tp.grad, x_ref.grad.chunk(world, -1)[rank]) < TOL


@pytest.mark.world_sizes(2, 4)
def test_fused_qkv_stride_keeps_each_ranks_heads(group, rank, world):
    torch.manual_seed(0)
    ref = Conv1D(3 * IN, IN)
    torch.nn.init.normal_(ref.bias)
    layer = Conv1D(3 * IN, IN)
    layer.load_state_dict(ref.state_dict())
    sch = create_schedule(layer, group)
    sch.shard("weight", axis=1, stride=3)
    sch.shard("bias", axis=0, stride=3)
    sch.sync("bwd_post", "all_reduce")
    x = torch.randn(B, S, IN)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    q, k, v = ref(x_ref).split(IN, dim=-1)
    lq, lk, lv = layer(x_tp).split(IN // world, dim=-1)
    # Use q, k and v differently, so each block's gradient is distinct.
    (q.sum() + 2 * k.square().sum() + 3 * v.sin().sum()).backward()
    (lq.sum() + 2 * lk.square().sum() + 3 * lv.sin().sum()).backward()
    for local, full in ((lq, q), (lk, k), (lv, v)):
        assert max_diff(local, full.chunk(world, -1)[rank]) < TOL
    assert max_diff(layer.weight.grad, expected_shard(ref.weight.grad, 1, rank, world, stride=3)) < TOL
    assert max_diff(layer.bias.grad, expected_shard(ref.bias.grad, 0, rank, world, stride=3)) < TOL
    assert max_diff(x_tp.grad, x_ref.grad) < TOL
    with pytest.raises(ms.SchedulingError, match="stride 3: gathering would interleave"):
        sch.sync("fwd_post", "all_gather")


@pytest.mark.world_sizes(2, 4)
def test_vocab_parallel_embedding(group, rank, world):
    torch.manual_seed(0)
    ref = nn.Embedding(16, IN, padding_idx=3)
    emb = nn.Embedding(16, IN, padding_idx=3)
    emb.load_state_dict(ref.state_dict())
    sch = create_schedule(emb, group)
    sch.shard("weight", axis=0)
    sch.sync("fwd_post", "all_reduce")
    # Every rank's first local id (0, 16/world, ...) appears: masking must not confuse them.
    ids = torch.tensor([[0, 4, 8, 12, 3, 15], [1, 5, 9, 13, 3, 2]])
    g = torch.randn(*ids.shape, IN)
    y_ref = ref(ids)
    (y_ref * g).sum().backward()
    y = emb(ids)
    (y * g).sum().backward()
    assert max_diff(y, y_ref) < TOL
    assert max_diff(emb.weight.grad, expected_shard(ref.weight.grad, 0, rank, world)) < TOL
    assert emb.num_embeddings == 16 // world


def test_embedding_hidden_parallel(group, rank, world):
    torch.manual_seed(0)
    ref = nn.Embedding(16, IN)
    emb = nn.Embedding(16, IN)
    emb.load_state_dict(ref.state_dict())
    sch = create_schedule(emb, group)
    sch.shard("weight", axis=1)
    sch.sync("fwd_post", "all_gather", axis=-1)
    ids = torch.randint(0, 16, (B, S))
    g = torch.randn(B, S, IN)
    (ref(ids) * g).sum().backward()
    y = emb(ids)
    (y * g).sum().backward()
    assert max_diff(y, ref(ids)) < TOL
    assert max_diff(emb.weight.grad, expected_shard(ref.weight.grad, 1, rank, world)) < TOL


def test_without_its_sync_a_row_parallel_layer_is_wrong(group, rank, world):
    """The parity checks above can fail: drop the reduction and the output no longer matches."""
    ref, layer = make("linear"), make("linear")
    create_schedule(layer, group).shard("weight", axis=1)
    x = torch.randn(B, S, IN)
    assert max_diff(layer(x.chunk(world, -1)[rank]), ref(x)) > 1e-2
