"""Misuse that only shows with more than one rank: sizes that do not divide the group."""

import pytest
import torch
from torch import nn

import megatron_slapo as ms
from megatron_slapo.plans.styles import ColumnParallel, LocalHeads, ParallelRegionInput, RowParallel, apply_plan


def test_shard_size_not_divisible_names_the_path(group, world):
    model = nn.Sequential(nn.Linear(8, 5))
    sch = ms.create_schedule(model, group)
    with pytest.raises(ms.SchedulingError, match=r"\[0\].*not divisible by the group size 2"):
        sch["0"].shard("weight", axis=0)
    assert model[0].weight.shape == (5, 8)  # nothing was changed


def test_heads_not_divisible_by_tp(group):
    attn = nn.Module()
    attn.num_heads = 3
    model = nn.ModuleDict({"attn": attn})
    with pytest.raises(ms.SchedulingError, match=r"\[attn\] num_heads=3 is not divisible"):
        apply_plan(ms.create_schedule(model, group), {"attn": LocalHeads("num_heads")})


def test_verify_raises_on_a_schedule_missing_a_sync(group, rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    sch = ms.create_schedule(model, group)
    x = torch.randn(4, 8)
    with pytest.raises(ms.VerificationError, match="differs"):
        with ms.Verify(sch, [x]):
            sch["0"].shard("weight", axis=0)
            sch["0"].shard("bias", axis=0)
            sch["0"].sync("bwd_post", "all_reduce")
            sch["2"].shard("weight", axis=1)  # the row-parallel all-reduce is missing


def test_verify_passes_the_complete_schedule(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    sch = ms.create_schedule(model, group)
    with ms.Verify(sch, [torch.randn(4, 8)]) as verify:
        sch["0"].shard("weight", axis=0)
        sch["0"].shard("bias", axis=0)
        sch["0"].sync("bwd_post", "all_reduce")
        sch["2"].shard("weight", axis=1)
        sch["2"].sync("fwd_post", "all_reduce")
    assert set(verify.report.grads) == {f"grad of {n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")}


class GatedMLP(nn.Module):
    """Llama's MLP shape: two column-parallel layers read the same input."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


REGION_PLAN = {
    "gate": ColumnParallel(reduce_input_grad=False),
    "up": ColumnParallel(reduce_input_grad=False),
    "down": RowParallel(),
}


def test_one_input_gradient_reduction_per_region_matches_one_process(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GatedMLP())  # the region's input gradient flows on to layer 0
    sch = ms.create_schedule(model, group)
    with ms.Verify(sch, [torch.randn(4, 8)]) as verify:
        apply_plan(sch, {"1": ParallelRegionInput(), **{f"1.{k}": v for k, v in REGION_PLAN.items()}})
    assert "grad of 0.weight" in verify.report.grads


def test_a_column_layer_left_without_its_region_is_refused(group):
    sch = ms.create_schedule(GatedMLP(), group)
    with pytest.raises(ms.SchedulingError, match=r"gate is ColumnParallel\(reduce_input_grad=False\) but no enclosing"):
        apply_plan(sch, REGION_PLAN)
    with pytest.raises(ms.SchedulingError, match="not a layer"):
        apply_plan(ms.create_schedule(GatedMLP(), group), {"gate": ParallelRegionInput()})


def test_plan_patterns_list_alternatives_and_may_be_optional(group):
    """``{gate,up}`` matches either name; a pattern ending in ``?`` may match nothing; others must."""
    sch = ms.create_schedule(GatedMLP(), group)
    applied = apply_plan(sch, {"{gate,up}": ColumnParallel(), "down": RowParallel(), "norm?": RowParallel()})
    assert applied == ["gate", "up", "down"]
    assert [sch[p].metadata.shards["weight"].axis for p in applied] == [0, 0, 1]
    with pytest.raises(ms.SchedulingError, match=r"plan pattern 'norm' matches no submodule of GatedMLP"):
        apply_plan(ms.create_schedule(GatedMLP(), group), {"norm": RowParallel()})
