"""Vocabulary parallelism: tied embedding + LM head + cross-entropy, against one device."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from megatron_slapo import create_schedule
from megatron_slapo.kernels.vocab import VocabParallelLMLoss, vocab_parallel_cross_entropy
from tests.utils import expected_shard, max_diff

V, H, TOL = 64, 16, 1e-5


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


@pytest.mark.world_sizes(2, 4)
def test_tied_embedding_head_and_cross_entropy(group, rank, world):
    torch.manual_seed(0)
    ref = TiedLM()
    tp = TiedLM()
    tp.load_state_dict(ref.state_dict())
    sch = create_schedule(tp, group)
    sch["emb"].shard("weight", axis=0)  # shards the tied head weight too
    sch["emb"].sync("fwd_post", "all_reduce")
    sch["head"].sync("bwd_post", "all_reduce")
    assert tp.head.weight is tp.emb.weight and tp.emb.weight.shape == (V // world, H)
    assert sch["head"].metadata.shards["weight"].axis == 0

    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = -100
    ref_loss = F.cross_entropy(ref(ids).view(-1, V), labels.view(-1))
    ref_loss.backward()
    logits = tp(ids)  # (3, 10, V / world)
    loss = vocab_parallel_cross_entropy(logits, labels, group).sum() / (labels != -100).sum()
    loss.backward()

    assert abs(loss.item() - ref_loss.item()) < TOL
    # The tied weight's gradient sums both uses (lookup and head).
    assert max_diff(tp.emb.weight.grad, expected_shard(ref.emb.weight.grad, 0, rank, world)) < TOL
    assert max_diff(tp.norm.weight.grad, ref.norm.weight.grad) < TOL


@pytest.mark.world_sizes(2, 4)
def test_vocab_parallel_cross_entropy_matches_torch(group, rank, world):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, V, generator=gen) * 4
    target = torch.randint(0, V, (5, 7), generator=gen)
    target[1, 2] = -100
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.view(-1, V), target.view(-1), reduction="none").view(5, 7)
    (ref * torch.arange(35.0).view(5, 7)).sum().backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    out = vocab_parallel_cross_entropy(local, target, group)
    (out * torch.arange(35.0).view(5, 7)).sum().backward()
    assert max_diff(out, ref) < TOL
    assert max_diff(local.grad, full.grad.chunk(world, -1)[rank]) < TOL
    assert torch.equal(local, logits.chunk(world, -1)[rank])  # megatron-core's in-place steps work on a copy


@pytest.mark.parametrize("kwargs", [{}, {"num_items_in_batch": torch.tensor(11)}])
def test_lm_loss_matches_hf_causal_loss(group, rank, world, kwargs):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 9, V, generator=gen)
    labels = torch.randint(0, V, (2, 9), generator=gen)
    labels[1, 4:] = -100  # padding
    full = logits.clone().requires_grad_()
    expected = ForCausalLMLoss(full, labels, vocab_size=V, **kwargs)
    expected.backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_()
    loss = VocabParallelLMLoss(group)(local, labels, vocab_size=V, **kwargs)
    loss.backward()
    assert abs(loss.item() - expected.item()) < TOL
    assert max_diff(local.grad, full.grad.chunk(world, -1)[rank]) < TOL


def test_bf16_logits(group, rank, world):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 8, V, generator=gen).bfloat16()
    target = torch.randint(0, V, (4, 8), generator=gen)
    ref = F.cross_entropy(logits.float().view(-1, V), target.view(-1), reduction="none").view(4, 8)
    out = vocab_parallel_cross_entropy(logits.chunk(world, -1)[rank], target, group)
    assert out.dtype == torch.float32 and max_diff(out, ref) < TOL  # computed in fp32 from bf16 inputs


def test_matches_megatron_core_vocab_parallel_cross_entropy(group, rank, world):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_ce

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 3, V, generator=gen)
    target = torch.randint(0, V, (6, 3), generator=gen)
    local = logits.chunk(world, -1)[rank]
    ours = vocab_parallel_cross_entropy(local, target, group)
    theirs = megatron_ce(local.clone(), target)
    assert max_diff(ours, theirs) < TOL
