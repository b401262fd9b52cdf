"""The expert-parallel dispatcher on one rank (its exchanges are then the identity): the same output
and gradients as the HF experts module it replaces, through the grouped GEMM and through the
model's own loop, with pairs dropped over capacity, and with no pair routed at all."""

import copy

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from megatron_slapo.compat.transformers_internals import grouped_experts_forward
from megatron_slapo.plans.expert_parallel import ExpertParallelForward, local_experts

TOKENS, TOPK, EXPERTS, HIDDEN = 12, 2, 4, 16


def _experts(width: int) -> Qwen3MoeExperts:
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, moe_intermediate_size=width)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    return experts


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOPK, generator=g).requires_grad_()
    return hidden, index, weights


def _run(forward, experts, hidden, index, weights):
    out = forward(experts, hidden, index, weights)
    out.pow(2).sum().backward()
    grads = [t.grad.clone() for t in (hidden, weights, experts.gate_up_proj, experts.down_proj)]
    for t in (hidden, weights, experts.gate_up_proj, experts.down_proj):
        t.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("width, grouped", [(32, True), (30, False)])  # 30: rows not 16-byte aligned on a CPU
def test_the_dispatcher_computes_what_the_hf_module_does(width, grouped):
    experts = _experts(width)
    hidden, index, weights = _inputs()
    if hidden.device.type == "cpu":
        assert (grouped_experts_forward(experts, hidden) is not None) == grouped
    reference = _run(type(experts).forward, copy.deepcopy(experts), hidden, index, weights)
    dispatched = _run(ExpertParallelForward(None, EXPERTS, "alltoall"), experts, hidden, index, weights)
    assert torch.allclose(dispatched[0], reference[0], atol=1e-6)
    for mine, theirs in zip(dispatched[1], reference[1], strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_pairs_dropped_over_capacity_are_not_computed_and_get_no_gradient():
    experts = _experts(32)
    hidden, index, weights = _inputs()
    dropped = index.clone()
    dropped[:4, 1] = EXPERTS  # the sentinel expert_capacity.py gives a dropped pair under expert parallelism
    out, grads = _run(ExpertParallelForward(None, EXPERTS, "alltoall"), experts, hidden, dropped, weights)
    kept = (weights * (dropped < EXPERTS)).detach().requires_grad_()  # the same pairs at weight 0, HF's way
    reference, theirs = _run(type(experts).forward, copy.deepcopy(experts), hidden, index, kept)
    assert torch.allclose(out, reference, atol=1e-6)
    assert torch.equal(grads[1][:4, 1], torch.zeros(4)) and torch.allclose(grads[0], theirs[0], atol=1e-6)


@pytest.mark.parametrize("width", [32, 30])
def test_with_no_pair_routed_here_the_backward_still_runs_through_the_experts(width):
    """A rank whose experts receive no row must still take part in the exchanges' backward: the
    local experts' output stays attached to the rows that (did not) arrive, both ways of computing."""
    experts = _experts(width)
    rows = torch.randn(0, HIDDEN, requires_grad=True)
    out = local_experts(experts, rows, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0, HIDDEN) and out.requires_grad
    out.sum().backward()
    assert rows.grad is not None and experts.gate_up_proj.grad is not None and not experts.gate_up_proj.grad.any()
