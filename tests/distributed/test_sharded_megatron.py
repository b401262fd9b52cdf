"""The megatron engine's state for a distributed checkpoint, in each of megatron-core's optimizers.

A same-layout round trip: engine A trains two steps, every run of its :meth:`sharded_state` and
its scalars are copied, and A trains two more; engine B, initialised from another seed, loads the
copy through :meth:`load_sharded_state` and trains the same two steps: the same losses, which
needs the weights, Adam's moments and step count and the LR schedule all restored. The runs of all
ranks must tile each tensor (replicas aside) so that a checkpoint holds every element; a fill that
writes other values must reach every weight of the model (through the distributed optimizer's
all-gather, under bf16 through the cast of the fp32 main copies). Cross-layout loading is tested
end to end through the trainer (``--ckpt-format torch_dist``).
"""

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed.runs import PARITY, random_batches

# The engine-level round trips; the trainer's resumes at another layout are test_engines.py's (one
# process's checkpoint at other layouts) and tests/test_reshard.py's (launches, in the slow tier).
# The README's suite runs DEFAULT's case; CI's slow tier the others (through tests/test_distributed.py's
# slow launch).

CASES = {  # megatron-core's optimizers: FP32Optimizer, DistributedOptimizer, Float16OptimizerWithFloat16Params
    "dp2-fp32": [],
    "dp2-fp32-distopt": ["--use-distributed-optimizer"],
    "dp2-bf16-distopt": ["--use-distributed-optimizer", "--bf16"],
    # fp32 main copies; the loss scale doubles every step, so its state must be restored too
    "dp2-fp16": "--fp16 --initial-loss-scale 1024 --loss-scale-window 1".split(),
    # two chunks per rank; the tied embeddings on both pipeline ranks
    "pp2-vpp2-tied": "--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 1".split(),
}
DEFAULT = "dp2-fp32-distopt"  # the README's suite's case (each rank its flat range); the slow tier runs the rest


def _setup(flags: list[str], seed: int, cache: str):
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.training.run import setup

    argv = [*PARITY, "--engine", "megatron", "--lr-warmup-fraction", "0", *flags, "--seed", str(seed),
            "--data-cache-path", cache]  # fmt: skip
    return setup(parse_args("gpt", argv))


def _train(run, steps: range) -> list[float]:
    """Each step's loss and loss scale (after the step, which the fp16 case doubles every step)."""
    results = [run.engine.train_step(random_batches(run, 100 * s + run.layout.dp_rank), run.task) for s in steps]
    return [value for r in results for value in (float(r.metrics["lm loss"]), r.loss_scale)]


def _weights(run) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in run.engine.model.state_dict().items()}


def _filler(snapshot: dict, scalars: dict, offset: float = 0.0):
    """A fill writing the snapshot (plus ``offset``) into the runs it is given, keyed alike."""

    def fill(state) -> None:
        for shards in state.params:
            for kind, run in shards.tensors.items():
                run.data.view(-1).copy_(snapshot[shards.names[0], kind, run.start].view(-1) + offset)
        state.scalars = copy.deepcopy(scalars)

    return fill


def _tiling(state) -> list[str]:
    """What the runs of all ranks fail to tile: per (tensor, state), runs either equal (replicas) or
    disjoint, together exactly the tensor's elements; every trainable weight has its moments."""
    mine = [(s.names[0], kind, run.start, run.data.numel(), math.prod(s.shape))
            for s in state.params for kind, run in s.tensors.items()]  # fmt: skip
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    runs: dict[tuple[str, str], set] = {}
    for name, kind, start, count, total in (r for rank in everyone for r in rank):
        runs.setdefault((name, kind), set()).add((start, start + count, total))
    problems = []
    for key, found in sorted(runs.items()):
        end, total = 0, next(iter(found))[2]
        for start, stop, _ in sorted(found):
            if start != end:
                problems.append(f"{key}: a run starts at {start}, after {end}")
            end = stop
        if end != total:
            problems.append(f"{key}: the runs end at {end} of {total}")
    weights = {name for name, kind in runs if kind == "weight"}
    problems += [f"{name}: no {kind}" for name in weights for kind in ("exp_avg", "exp_avg_sq")
                 if (name, kind) not in runs]  # fmt: skip
    return problems


@pytest.mark.parametrize("flags", [pytest.param(flags, id=name, marks=[] if name == DEFAULT else [pytest.mark.slow])
                                   for name, flags in CASES.items()])  # fmt: skip
def test_a_reloaded_engine_trains_on_as_the_one_it_saved(flags, shared_tmp):
    cache = os.path.join(shared_tmp, "cache")
    a = _setup(flags, 1234, cache)
    _train(a, range(2))
    state = a.engine.sharded_state()
    problems = _tiling(state)
    snapshot = {
        (s.names[0], kind, run.start): run.data.clone() for s in state.params for kind, run in s.tensors.items()
    }
    scalars = copy.deepcopy(state.scalars)
    saved = _weights(a)
    expected = _train(a, range(2, 4))

    b = _setup(flags, 4321, cache)
    fresh = _weights(b)
    b.engine.load_sharded_state(_filler(snapshot, scalars))
    loaded = _weights(b)
    losses = _train(b, range(2, 4))
    b.engine.load_sharded_state(_filler(snapshot, scalars, offset=1.0), load_optimizer=False)
    garbage = _weights(b)
    tied = _tied_copies_agree(b) if "--pipeline-model-parallel-size" in flags else True

    assert not problems, problems
    assert scalars["optimizer_step"] == 2.0
    assert set(scalars) == {"optimizer_step", "opt_param_scheduler", *(["grad_scaler"] if "--fp16" in flags else [])}
    assert any(not torch.equal(fresh[k], saved[k]) for k in saved)  # B starts elsewhere
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert losses == pytest.approx(expected, rel=1e-6, abs=0), (losses, expected)
    assert all(bool((garbage[k] != loaded[k]).all()) for k in loaded)
    assert tied


def _tied_copies_agree(run) -> bool:
    """Some weight (the tied embedding) is described by both pipeline ranks, under the same names,
    and both copies hold the same values."""
    weights = {tuple(s.names): s.tensors["weight"].data for s in run.engine.sharded_state(False).params}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(weights))
    shared = sorted(set.intersection(*(set(names) for names in everyone)))
    if not shared:
        return False
    copies = [torch.empty_like(weights[shared[0]]) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, weights[shared[0]].contiguous())
    return all(torch.equal(c, copies[0]) for c in copies)
