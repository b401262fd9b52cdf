"""fork_rng across tensor-parallel ranks, and checkpoint replaying the forked stream."""

import torch
import torch.distributed as dist
from torch import nn

from megatron_slapo import create_schedule
from megatron_slapo.parallel import seed
from megatron_slapo.parallel.collectives import gather_tensor


def masks(group, rank, forked: bool) -> list[torch.Tensor]:
    module = nn.Sequential(nn.Dropout(0.5))
    if forked:
        create_schedule(module, group)["0"].fork_rng()
    seed(1234, tensor_parallel_rank=rank)
    mask = module(torch.ones(64)) != 0
    return list(gather_tensor(mask.unsqueeze(0), 0, group).unbind(0))


def test_dropout_masks_differ_across_ranks_only_when_forked(group, rank, world):
    plain = masks(group, rank, forked=False)
    forked = masks(group, rank, forked=True)
    assert all(torch.equal(plain[0], m) for m in plain[1:]), "replicated dropout must agree across TP ranks"
    assert not any(torch.equal(forked[0], m) for m in forked[1:]), "forked dropout must differ across TP ranks"
    assert not torch.equal(forked[rank], plain[rank])


def test_checkpoint_replays_forked_dropout(group, rank, world):
    def make(checkpointed: bool) -> nn.Module:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 16), nn.Dropout(0.3))
        sch = create_schedule(module, group)
        sch["1"].fork_rng()  # partitioned-region dropout
        if checkpointed:
            sch.checkpoint()
        return module

    results = []
    for checkpointed in (False, True):
        module = make(checkpointed)
        seed(7, tensor_parallel_rank=rank)
        x = torch.randn(4, 16, requires_grad=True)
        module(x).square().sum().backward()
        results.append([x.grad] + [p.grad for p in module.parameters()])
    for plain, recomputed in zip(*results, strict=True):
        assert torch.equal(plain, recomputed)
    dist.barrier(group)
