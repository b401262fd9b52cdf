"""q|k|v and gate|up as one GEMM each (kernels/shared_input.py), against the layers computed apart."""

import copy

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.kernels.shared_input import MISSES_BEFORE_GIVING_UP, fuse_projections
from megatron_slapo.parallel.random import seed
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
        (model.b(xi).sum() * 2 + (model.a(xi) * torch.arange(4.0)).sum()).backward()
        model.x_grad = xi.grad
    for (name, p), q in zip(block.named_parameters(), plain.parameters(), strict=True):
        assert max_diff(p.grad, q.grad) < 1e-6, name
    assert max_diff(block.x_grad, plain.x_grad) < 1e-6


def test_layers_called_on_different_inputs_compute_apart_and_stop_trying():
    torch.manual_seed(0)
    plain = TwoProjections()
    block = copy.deepcopy(plain)
    fuse_projections(ms.create_schedule(block), ["a", "b"])
    shared = block.a.shared_input
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.allclose(block.b(x), plain.b(x)) and torch.allclose(block.a(x), plain.a(x))  # one input: fused
    for _ in range(MISSES_BEFORE_GIVING_UP):  # another input each time: each layer's own product
        assert torch.allclose(block.a(x), plain.a(x), atol=1e-6) and torch.allclose(block.b(y), plain.b(y), atol=1e-6)
    assert not shared.enabled and shared.pending is None


def test_layers_that_are_not_one_gemm_are_refused():
    block = TwoProjections()
    block.b = nn.Linear(8, 6, bias=False)
    with pytest.raises(SchedulingError, match="a, b differ in input width or in having a bias"):
        fuse_projections(ms.create_schedule(block), ["a", "b"])
    with pytest.raises(SchedulingError, match="fusing needs two or more nn.Linear children, got a"):
        fuse_projections(ms.create_schedule(block), ["a"])
