"""Sequence parallelism: LayerNorm on a sequence shard, all-gather into the MLP, reduce-scatter out.

The block is ``x + mlp(ln(x))`` in HF's batch-first layout, so the sequence is dim 1. Each rank
holds ``S / world`` positions of ``x``; the LayerNorm's gradients are partial sums until
``allreduce_sequence_parallel_grads`` (Megatron's treatment of ``sequence_parallel`` params).
"""

import pytest
import torch
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

from megatron_slapo import create_schedule
from megatron_slapo.parallel.collectives import allreduce_sequence_parallel_grads
from tests.utils import assert_grads_match, max_diff, tiny_gpt2_config

TOL = 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = tiny_gpt2_config()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.mlp = GPT2MLP(4 * cfg.n_embd, cfg)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


def sequence_parallel(sch):
    sch["ln"].annotate("weight", "sequence_parallel", True)
    sch["ln"].annotate("bias", "sequence_parallel", True)
    fc, proj = sch["mlp.c_fc"], sch["mlp.c_proj"]
    fc.shard("weight", axis=1)
    fc.shard("bias", axis=0)
    fc.sync("fwd_pre", "all_gather", axis=1)  # backward: reduce-scatter
    proj.shard("weight", axis=0)
    proj.sync("fwd_post", "reduce_scatter", axis=1)  # backward: all-gather


@pytest.mark.world_sizes(2, 4)
def test_sequence_parallel_block(group, rank, world):
    torch.manual_seed(0)
    ref = Block()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.1)
    sp = Block()
    sp.load_state_dict(ref.state_dict())
    sequence_parallel(create_schedule(sp, group))

    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    x_ref = x.clone().requires_grad_()
    x_sp = x.chunk(world, dim=1)[rank].clone().requires_grad_()
    y_ref, y = ref(x_ref), sp(x_sp)
    (y_ref * g).sum().backward()
    (y * g.chunk(world, dim=1)[rank]).sum().backward()
    allreduce_sequence_parallel_grads(sp, group)

    assert max_diff(y, y_ref.chunk(world, dim=1)[rank]) < TOL
    assert max_diff(x_sp.grad, x_ref.grad.chunk(world, dim=1)[rank]) < TOL
    assert_grads_match(sp, ref, rank, world)
    assert sp.ln.weight.sequence_parallel and not hasattr(sp.mlp.c_fc.weight, "sequence_parallel")
