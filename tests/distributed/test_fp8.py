"""FP8 layers split by tensor parallelism compute what one process's FP8 layers compute: each
scale is agreed over the ranks that split the tensor it scales (emulated FP8, fp32 around it)."""

import copy
import dataclasses
from collections import OrderedDict

import pytest
import torch
from torch import nn
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.llama.modeling_llama import LlamaMLP

from megatron_slapo import create_schedule
from megatron_slapo.kernels.fp8 import Fp8Recipe, Splits, fp8_product
from megatron_slapo.metadata import Role
from megatron_slapo.parallel.collectives import reduce_forward
from tests.distributed.test_mlp_tp import built_pair, column, row
from tests.utils import local_part, max_diff, tiny_gpt2_config, tiny_llama_config

TOL = 1e-5


def gpt2():
    cfg = tiny_gpt2_config()
    return (lambda: GPT2MLP(4 * cfg.n_embd, cfg)), {"c_fc": (column, 1), "c_proj": (row, 0)}, cfg.n_embd


def llama():
    cfg = tiny_llama_config()
    return (lambda: LlamaMLP(cfg)), {"gate_proj": (column, 0), "up_proj": (column, 0), "down_proj": (row, 1)}, 32


def relative_diff(a, b):
    """The largest difference relative to ``b``'s largest magnitude (fp32 sums of large FP8 products)."""
    return max_diff(a, b) / b.abs().max().item()


def _run(model, hidden):
    x = torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(2, 16, hidden, generator=torch.Generator().manual_seed(2))
    y = model(x)
    (y * g).sum().backward()
    return y, x.grad


def _recipe(name):
    """``rowwise-exact``: rowwise with scales not rounded to powers of 2. A rounded scale hides a
    disagreement (two ranks' powers of 2 only shift exponents), this one shows any, so the rowwise
    casts' split dimensions are checked exactly."""
    recipe = Fp8Recipe(name.removesuffix("-exact"), "hybrid", emulate=True)
    if name.endswith("-exact"):
        recipe.__dict__["config"] = dataclasses.replace(recipe.config, round_scales_to_power_of_2=False)
    return recipe


def _pair(case, recipe, group):
    """One process's FP8 model and its tensor-parallel copy (same weights), both in FP8; the first
    half of each weight along its split is scaled up, so that the shards' amaxes differ."""
    make, layers, hidden = case()
    fp8 = _recipe(recipe)
    ref, tp = built_pair(make)
    with torch.no_grad():  # one rank's shard 3 times the other's (not a power of 2, which a rowwise scale rounds to): a shard's own amax is not the whole's
        for model in (ref, tp):
            for path, (_, axis) in layers.items():
                weight = model.get_submodule(path).weight
                weight.narrow(axis, 0, weight.size(axis) // 2).mul_(3)
    unscaled = copy.deepcopy(ref)  # the same weights without FP8
    plain, sch = create_schedule(ref, None), create_schedule(tp, group)
    for path, (place, axis) in layers.items():
        place(sch[path], axis)
        sch[path].fp8(fp8)
        plain[path].fp8(fp8)
    assert {sch[path].metadata.role for path in layers} == {Role.COLUMN, Role.ROW}
    return ref, tp, hidden, unscaled


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise-exact"])
@pytest.mark.parametrize("case", [gpt2, llama])
def test_split_fp8_layers_cast_what_one_process_casts(group, rank, world, case, recipe):
    ref, tp, hidden, unscaled = _pair(case, recipe, group)
    y_ref, dx_ref = _run(ref, hidden)
    y, dx = _run(tp, hidden)
    assert relative_diff(y, y_ref) < TOL
    assert relative_diff(dx, dx_ref) < TOL
    for name, p in tp.named_parameters():
        full = dict(ref.named_parameters())[name].grad
        assert relative_diff(p.grad, local_part(full, p, rank, world)) < TOL, name
    fp32, _ = _run(unscaled, hidden)
    assert relative_diff(y_ref, fp32) > 1e-3  # it is FP8: 3 bits of mantissa move the output


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise-exact"])
def test_scales_of_each_shard_alone_would_not_compute_what_one_process_does(group, monkeypatch, recipe):
    """The agreement matters: with each rank's amax its own, a TP2 layer rounds otherwise."""
    monkeypatch.setattr("megatron_slapo.kernels.fp8.all_reduce_max", lambda amax, group: amax)
    ref, tp, hidden, _ = _pair(llama, recipe, group)
    (y_ref, dx_ref), (y, dx) = _run(ref, hidden), _run(tp, hidden)
    assert max(relative_diff(y, y_ref), relative_diff(dx, dx_ref)) > 1e-3


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise-exact"])
def test_a_sequence_split_over_ranks_agrees_its_scales_over_them(group, rank, world, recipe):
    """Context parallelism: each rank holds part of the tokens, and a scale over tokens (tensorwise;
    rowwise's for the weight gradient) spans every rank's, so the outputs are one process's rows
    and the weight gradients, summed over the ranks, one process's."""
    fp8 = _recipe(recipe)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4 * world, 32, generator=generator)
    x[: 4 * world // 2] *= 3  # the first ranks' tokens larger: their amax is not the others'
    weight = torch.randn(48, 32, generator=generator)
    g = torch.randn(4 * world, 48, generator=generator)

    def product(x, splits):
        x, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = fp8_product(x, w, True, fp8, splits)
        (y * g[rows] if splits.tokens else y * g).sum().backward()
        return y, x.grad, w.grad

    rows = slice(4 * rank, 4 * (rank + 1))
    y_ref, dx_ref, dw_ref = product(x, Splits())
    y, dx, dw = product(x[rows], Splits(tokens=(group,)))
    dw = reduce_forward(dw, group)  # the weight gradient's partial sums
    assert relative_diff(y, y_ref[rows]) < TOL
    assert relative_diff(dx, dx_ref[rows]) < TOL
    assert relative_diff(dw, dw_ref) < TOL


def test_fsdp_gathers_fp8_weights_in_float8_and_computes_what_one_process_does(group, rank, world):
    """--fp8-param-gather: FSDP2 all-gathers each FP8 layer's weight shards already cast (half of
    bf16's bytes), with the whole weight's scale, so the layer computes what it computes unsharded."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from megatron_slapo.compat.torchao_float8 import is_float8
    from megatron_slapo.kernels.fp8 import gather_weights_in_fp8

    make, mlp_layers, hidden = llama()
    # a norm beside the MLP: FSDP2 gathers a unit of float8 and bf16 tensors as bytes (gloo has no float8)
    ref, sharded = built_pair(lambda: nn.Sequential(OrderedDict(norm=nn.LayerNorm(hidden), mlp=make())))
    layers = [f"mlp.{path}" for path in mlp_layers]
    recipe = _recipe("tensorwise")
    for model in (ref, sharded):
        sch = create_schedule(model, None)
        for path in layers:
            sch[path].fp8(recipe)
    assert gather_weights_in_fp8(sharded) == len(layers)
    fully_shard(sharded, mesh=DeviceMesh.from_group(group, "cpu"))
    seen = []
    for path in layers:
        sharded.get_submodule(path).register_forward_pre_hook(lambda m, args: seen.append(is_float8(m.weight)))
    y_ref, dx_ref = _run(ref, hidden)
    y, dx = _run(sharded, hidden)
    assert seen == [True] * len(layers)
    assert relative_diff(y, y_ref) < TOL and relative_diff(dx, dx_ref) < TOL
