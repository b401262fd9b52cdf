"""Every sync mode x op, forward and backward, against closed-form expectations.

The module is ``y = w * x`` with a replicated scalar ``w``; rank s feeds ``x_s`` and weights its
output gradient with ``g_s``. All ``x_s`` and ``g_s`` come from per-rank seeds, so every rank can
write down the expected outputs and input gradients of every collective without communicating.
"""

import pytest
import torch
from torch import nn

from megatron_slapo import create_schedule
from tests.utils import max_diff

B, S, H = 2, 4, 8
W = 2.0


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(W))

    def forward(self, x):
        return self.w * x


def per_rank(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def run(group, rank, mode, op, **kw):
    module = Scale()
    sch = create_schedule(module, group)
    sch.sync(mode, op, **kw)
    x = per_rank(100 + rank, (B, S, H)).requires_grad_()
    y = module(x)
    g = per_rank(200 + rank, y.shape)
    (y * g).sum().backward()
    return y.detach(), x.grad


def xs(world):
    return [per_rank(100 + s, (B, S, H)) for s in range(world)]


def gs(world, shape):
    return [per_rank(200 + s, shape) for s in range(world)]


@pytest.mark.world_sizes(2, 4)
def test_fwd_post_all_reduce_is_megatron_g(group, rank, world):
    y, dx = run(group, rank, "fwd_post", "all_reduce")
    assert max_diff(y, W * sum(xs(world))) < 1e-6
    assert max_diff(dx, W * gs(world, y.shape)[rank]) < 1e-6  # identity backward


@pytest.mark.world_sizes(2, 4)
def test_bwd_post_all_reduce_is_megatron_f(group, rank, world):
    y, dx = run(group, rank, "bwd_post", "all_reduce")
    assert max_diff(y, W * xs(world)[rank]) < 1e-6  # identity forward
    assert max_diff(dx, W * sum(gs(world, y.shape))) < 1e-6


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("backward", ["split", "reduce_scatter"])
def test_fwd_post_all_gather(group, rank, world, backward):
    y, dx = run(group, rank, "fwd_post", "all_gather", axis=1, backward=backward)
    assert max_diff(y, W * torch.cat(xs(world), dim=1)) < 1e-6
    grads = gs(world, y.shape)
    if backward == "split":
        expected = grads[rank].chunk(world, dim=1)[rank]
    else:
        expected = sum(grads).chunk(world, dim=1)[rank]
    assert max_diff(dx, W * expected) < 1e-6


@pytest.mark.world_sizes(2, 4)
def test_fwd_post_reduce_scatter(group, rank, world):
    y, dx = run(group, rank, "fwd_post", "reduce_scatter", axis=1)
    assert max_diff(y, (W * sum(xs(world))).chunk(world, dim=1)[rank]) < 1e-6
    assert max_diff(dx, W * torch.cat(gs(world, y.shape), dim=1)) < 1e-6  # all-gather backward


@pytest.mark.world_sizes(2, 4)
def test_fwd_post_scatter(group, rank, world):
    y, dx = run(group, rank, "fwd_post", "scatter", axis=-1)
    assert max_diff(y, (W * xs(world)[rank]).chunk(world, dim=-1)[rank]) < 1e-6
    assert max_diff(dx, W * torch.cat(gs(world, y.shape), dim=-1)) < 1e-6


@pytest.mark.world_sizes(2, 4)
def test_fwd_pre_all_gather_with_reduce_scatter_backward(group, rank, world):
    y, dx = run(group, rank, "fwd_pre", "all_gather", axis=1, backward="reduce_scatter")
    assert max_diff(y, W * torch.cat(xs(world), dim=1)) < 1e-6
    assert max_diff(dx, W * sum(gs(world, y.shape)).chunk(world, dim=1)[rank]) < 1e-6


def test_fwd_pre_all_reduce(group, rank, world):
    y, dx = run(group, rank, "fwd_pre", "all_reduce")
    assert max_diff(y, W * sum(xs(world))) < 1e-6
    assert max_diff(dx, W * gs(world, y.shape)[rank]) < 1e-6


def test_callable_ops(group, rank, world):
    y, dx = run(group, rank, "fwd_post", lambda t: 3 * t)
    assert max_diff(y, 3 * W * xs(world)[rank]) < 1e-6
    assert max_diff(dx, 3 * W * gs(world, y.shape)[rank]) < 1e-6
    y, dx = run(group, rank, "bwd_post", lambda grad: 5 * grad)
    assert max_diff(y, W * xs(world)[rank]) < 1e-6
    assert max_diff(dx, 5 * W * gs(world, y.shape)[rank]) < 1e-6


def test_fwd_pre_reaches_keyword_inputs(group, rank, world):
    module = Scale()
    create_schedule(module, group).sync("fwd_pre", "all_reduce")
    y = module(x=xs(world)[rank])
    assert max_diff(y, W * sum(xs(world))) < 1e-6


def test_fwd_post_on_tuple_output(group, rank, world):
    class Pair(Scale):
        def forward(self, x):
            return self.w * x, "aux"

    module = Pair()
    create_schedule(module, group).sync("fwd_post", "all_reduce")
    y, aux = module(xs(world)[rank])
    assert aux == "aux" and max_diff(y, W * sum(xs(world))) < 1e-6


def test_layer_outputs_are_all_reduced_in_place_and_stay_exact(group, monkeypatch):
    """A vocabulary-parallel lookup and a row-parallel product are reduced where they were computed
    (no copy of b·s·h per collective); values and gradients stay those of the unsharded model."""
    import torch.nn.functional as F

    import megatron_slapo as ms
    from megatron_slapo.primitives import sync

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    sch = create_schedule(model, group)
    ids = torch.arange(12).reshape(2, 6)
    with ms.Verify(sch, [ids]):
        sch["0"].shard("weight", axis=0)
        sch["0"].sync("fwd_post", "all_reduce")
        sch["1"].shard("weight", axis=0)
        sch["1"].sync("bwd_post", "all_reduce")
        sch["2"].shard("weight", axis=1)
        sch["2"].sync("fwd_post", "all_reduce")
    computed: list[torch.Tensor] = []  # what the lookup and the product returned, before their reduction

    def recording(fn):
        return lambda *args, **kwargs: computed.append(fn(*args, **kwargs)) or computed[-1]

    monkeypatch.setattr(sync, "vocab_parallel_embedding", recording(sync.vocab_parallel_embedding))
    monkeypatch.setattr(F, "linear", recording(F.linear))
    outputs = []
    for i in (0, 2):
        model[i].register_forward_hook(lambda m, args, out: outputs.append(out))
    model(ids)
    assert [out.data_ptr() for out in outputs] == [computed[0].data_ptr(), computed[2].data_ptr()]
