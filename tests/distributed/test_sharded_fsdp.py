"""FSDP2's state for a distributed checkpoint (``--ckpt-format torch_dist``), at engine level.

Each rank describes the rows of every weight and AdamW moment it holds (engines/sharded_state.py),
and loading writes into those rows in place. Here: the rows are where ``torch.chunk`` puts them
and the live storage; an engine built from another seed and loaded from a trained engine's state
trains on with the same losses. Resharding through the checkpoint is tested with the trainer.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from megatron_slapo.engines.fsdp import local_run
from megatron_slapo.engines.sharded_state import WEIGHT
from tests.distributed.runs import PARITY, TP2, random_batches

# The engine-level round trips; the trainer's resumes at another layout are test_engines.py's (one
# process's checkpoint at FSDP2, among others) and tests/test_reshard.py's (launches, in the slow tier).
# The README's suite runs the fp32 round trip; CI's slow tier the rest (through tests/test_distributed.py's
# slow launch).

# 33 positions: the position embeddings' rows split 17 / 16, unevenly
FSDP = [*PARITY, "--engine", "fsdp", "--lr-warmup-fraction", "0", "--max-position-embeddings", "33"]


def _setup(flags: list[str], cache: str):
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.training.run import setup

    run = setup(parse_args("gpt", [*FSDP, *flags, "--data-cache-path", cache]))
    run.reporter.close()  # nothing is reported here
    return run


def _snapshot(state) -> tuple[dict[tuple[str, str, int], torch.Tensor], dict]:
    """A copy of every run, keyed by (first name, state name, start), and of the scalars."""
    runs = {(p.names[0], k, run.start): run.data.clone() for p in state.params for k, run in p.tensors.items()}
    return runs, copy.deepcopy(state.scalars)


def _fill(runs: dict, scalars: dict, garbage: bool = False):
    """A ``fill`` that loads the snapshot (or, with ``garbage``, random numbers into every run)."""

    def fill(state) -> None:
        for p in state.params:
            for k, run in p.tensors.items():
                saved = runs[(p.names[0], k, run.start)]
                run.data.view(-1).copy_(torch.rand_like(saved).view(-1) if garbage else saved.view(-1))
        state.scalars = copy.deepcopy(scalars)

    return fill


def _gathered(value) -> list:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _tiles(extents: list[tuple[int, int]], numel: int) -> bool:
    """Whether the runs ``(start, length)`` of the ranks cover ``[0, numel)`` once, in rank order."""
    end = 0
    for start, length in extents:
        if start != end:
            return False
        end += length
    return end == numel


@pytest.mark.slow
def test_the_runs_are_torch_chunk_rows_of_the_live_shards():
    """A (3, 4) weight splits 2 / 1 rows, a (1, 3) one 1 / 0 (an empty shard on rank 1): each rank's
    run is its rows of the whole tensor, the runs tile it, and writing into a run writes the weight."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("test-sharded-fsdp",))
    torch.manual_seed(0)
    module = fully_shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)), mesh=mesh)
    found = {}
    for name, p in module.named_parameters():
        run = local_run(p)
        whole = p.full_tensor().view(-1)
        correct = torch.equal(run.data.view(-1), whole[run.start : run.start + run.data.numel()])
        run.data.fill_(7.0)
        written = p.full_tensor().view(-1)
        found[name] = (run.start, run.data.numel(), correct, p.numel(), written)
    extents = _gathered({k: v[:2] for k, v in found.items()})
    for name, (start, length, correct, numel, written) in found.items():
        assert correct, name
        assert _tiles([ranks[name] for ranks in extents], numel), (name, extents)
        assert written[start : start + length].eq(7.0).all(), name
    assert found["1.weight"][:2] == ((0, 3) if dist.get_rank() == 0 else (3, 0))


PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "1024"]}


@pytest.mark.parametrize("flags", [pytest.param(flags, id=name, marks=[] if name == "fp32" else [pytest.mark.slow])
                                   for name, flags in PRECISIONS.items()])  # fmt: skip
def test_a_fresh_engine_loaded_from_the_state_trains_on_identically(cache, flags):
    """Engine A trains 2 steps, its state is copied, A trains 3 more. Engine B (another seed) loads
    the copy: it holds exactly the copy, and its next 2 losses are A's. Then B loads garbage and its
    next loss is no longer A's (the load does reach the engine)."""
    a = _setup([*flags, "--seed", "1234"], cache)
    for step in range(2):
        a.engine.train_step(random_batches(a, 1000 * step + dist.get_rank()), a.task)
    state = a.engine.sharded_state()
    runs, scalars = _snapshot(state)
    weights = {p.names[0]: p.tensors[WEIGHT] for p in state.params}
    whole = a.engine.full_state_dict()  # gathered over DP: what the runs must be rows of
    correct = {name: torch.equal(run.data.view(-1), whole[name].view(-1)[run.start : run.start + run.data.numel()])
               for name, run in weights.items()}  # fmt: skip
    extents = _gathered({name: (run.start, run.data.numel()) for name, run in weights.items()})
    moments_start_with_weights = all(run.start == p.tensors[WEIGHT].start for p in state.params
                                      for run in p.tensors.values())  # fmt: skip
    expected = [a.engine.train_step(random_batches(a, 1000 * step + dist.get_rank()), a.task) for step in range(2, 5)]

    b = _setup([*flags, "--seed", "4321"], cache)  # A's groups are gone from here on
    fresh, _ = _snapshot(b.engine.sharded_state(include_optimizer=False))
    b.engine.load_sharded_state(_fill(runs, scalars))
    loaded, loaded_scalars = _snapshot(b.engine.sharded_state())
    resumed = [b.engine.train_step(random_batches(b, 1000 * step + dist.get_rank()), b.task) for step in range(2, 4)]
    b.engine.load_sharded_state(_fill(runs, scalars, garbage=True))
    spoiled = b.engine.train_step(random_batches(b, 1000 * 4 + dist.get_rank()), b.task)

    assert all(correct.values()), correct
    assert all(_tiles([ranks[name] for ranks in extents], whole[name].numel()) for name in weights), extents
    assert moments_start_with_weights
    assert {run.data.dtype for run in weights.values()} == {torch.float32}  # fp32 shards under --bf16/--fp16 too
    assert {k[1] for k in runs} == {"weight", "exp_avg", "exp_avg_sq"} and scalars["optimizer_step"] == 2
    assert ("grad_scaler" in scalars) == ("--fp16" in flags)
    assert any(not torch.equal(fresh[k], runs[k]) for k in fresh)  # B starts elsewhere
    assert loaded.keys() == runs.keys() and all(torch.equal(loaded[k], runs[k]) for k in runs)
    assert loaded_scalars == scalars
    for want, got in zip(expected[:2], resumed, strict=True):
        assert math.isclose(got.metrics["lm loss"], want.metrics["lm loss"], rel_tol=1e-6), (want, got)
        assert got.learning_rate == want.learning_rate
    assert not math.isclose(spoiled.metrics["lm loss"], expected[2].metrics["lm loss"], rel_tol=1e-3)


@pytest.mark.slow
def test_tensor_parallel_shards_keep_their_partition(cache):
    """fully_shard replaces the parameters: Megatron's axis and stride of each tensor-parallel shard
    (gpt_tp on GPT-2: HF's Conv1D keeps its weight as (in, out), q|k|v interleaved by 3) survive it."""
    run = _setup(TP2, cache)  # TP2 x DP1
    state = run.engine.sharded_state(include_optimizer=False)
    partitions = {p.names[0]: p.partition for p in state.params}
    layer = "transformer.h.0."
    assert partitions["transformer.wte.weight"] == (0, 1)  # vocabulary-parallel
    assert partitions[layer + "attn.c_attn.weight"] == (1, 3) and partitions[layer + "attn.c_attn.bias"] == (0, 3)
    assert partitions[layer + "mlp.c_fc.weight"] == (1, 1) and partitions[layer + "mlp.c_proj.weight"] == (0, 1)
    assert partitions[layer + "mlp.c_proj.bias"] is None and partitions["transformer.wpe.weight"] is None
