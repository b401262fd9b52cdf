"""q|k|v and gate|up as one GEMM each (kernels/shared_input.py), against the layers computed apart."""

import contextlib
import copy

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.parallel.random import seed
from megatron_slapo.plans.fusion import fuse_projections
from schedules import llama_tp
from tests.utils import max_diff, tiny_llama_config


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products (mm, addmm) that run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logits, every gradient of a weighted sum of them, and the matrix products of the forward."""
    model.zero_grad(set_to_none=True)
    with CountMatmuls() as counted:
        logits = model(ids).logits
    (logits * torch.linspace(-1, 1, logits.size(-1))).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, counted.count


def test_llama_tp_multiplies_qkv_and_gate_up_once_with_the_same_results():
    config = tiny_llama_config(num_key_value_heads=2)
    seed(0)  # the attention's dropout runs on the model-parallel stream (no dropout here: p = 0)
    plain = transformers.LlamaForCausalLM(config)
    fused = copy.deepcopy(plain)
    llama_tp.apply(ms.create_schedule(fused), config)  # one process: the plan splits nothing
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    logits, grads, products = _run(plain, ids)
    fused_logits, fused_grads, fused_products = _run(fused, ids)
    assert max_diff(fused_logits, logits) < 1e-5
    assert fused_grads.keys() == grads.keys() and max(max_diff(fused_grads[n], grads[n]) for n in grads) < 1e-5
    layers = config.num_hidden_layers
    assert products - fused_products == 3 * layers  # q, k, v -> 1 and gate, up -> 1 per layer
    assert fused.state_dict().keys() == plain.state_dict().keys()  # the layers and their names stay


class TwoProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 6)


def test_fused_layers_with_biases_give_every_gradient():
    torch.manual_seed(0)
    plain = TwoProjections()
    block = copy.deepcopy(plain)
    fuse_projections(ms.create_schedule(block), ["a", "b"])
    x = torch.randn(2, 3, 8)
    for model in (plain, block):
        xi = x.clone().requires_grad_()
        (model.b(input=xi).sum() * 2 + (model.a(xi) * torch.arange(4.0)).sum()).backward()  # nn.Linear's keyword
        model.x_grad = xi.grad
    for (name, p), q in zip(block.named_parameters(), plain.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) < 1e-6, name
    assert max_diff(block.x_grad, plain.x_grad) < 1e-6


@pytest.mark.parametrize("how", ["another input", "changed in place", "no grad for one layer"])
def test_parts_from_another_input_are_not_served_and_fusing_stops(how):
    torch.manual_seed(0)
    plain = TwoProjections()
    block = copy.deepcopy(plain)
    fuse_projections(ms.create_schedule(block), ["a", "b"])
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad() if how == "no grad for one layer" else contextlib.nullcontext():
        a = block.a(x)  # holds b's part of x @ [a; b]
    assert max_diff(a, plain.a(x)) < 1e-6
    y = torch.randn(3, 8) if how == "another input" else x
    if how == "changed in place":
        with torch.no_grad():
            y.mul_(2)
    b = block.b(y)  # its own product: the part held was computed from another input
    assert max_diff(b, plain.b(y)) < 1e-6 and b.grad_fn is not None
    assert not block.a.shared_input.enabled and block.a.shared_input.pending is None


def test_under_autocast_each_layer_computes_as_autocast_casts_it():
    torch.manual_seed(0)
    plain = TwoProjections()
    block = copy.deepcopy(plain)
    fuse_projections(ms.create_schedule(block), ["a", "b"])
    x = torch.randn(3, 8)
    results = []
    for model in (plain, block):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.a(x).float().sum() + model.b(x).float().sum()
        out.backward()
        results.append([out.detach(), *(p.grad for p in model.parameters())])
    assert all(torch.equal(p, q) for p, q in zip(*results, strict=True))
    assert block.a.shared_input.enabled  # it just stood aside


def test_layers_that_are_not_one_gemm_are_refused():
    block = TwoProjections()
    block.b = nn.Linear(8, 6, bias=False)
    with pytest.raises(SchedulingError, match="a, b differ in input width or in having a bias"):
        fuse_projections(ms.create_schedule(block), ["a", "b"])
    with pytest.raises(SchedulingError, match="fusing needs two or more nn.Linear children, got a"):
        fuse_projections(ms.create_schedule(block), ["a"])
    block.b = nn.Linear(8, 6)
    fuse_projections(ms.create_schedule(block), ["a", "b"])
    with pytest.raises(SchedulingError, match="a, b: a layer already computes in a way of its own"):
        fuse_projections(ms.create_schedule(block), ["a", "b"])  # twice
