"""A step whose gradients are not finite on one rank is skipped on every rank, by every engine.

Without a loss scaler (fp32, bf16) nothing else checks: an optimizer that steps on a NaN gradient
leaves NaN weights for good. With the distributed optimizer each rank only sees the reduced
gradients of its own shard, so the verdict must be global, or ranks disagree about stepping (and
the skipping rank waits forever in the step's collectives).
"""

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed.runs import PARITY, random_batches

MEGATRON = ["--engine", "megatron"]
ENGINES = {
    "ddp": ["--engine", "ddp"],
    "fsdp": ["--engine", "fsdp"],
    "zero1": ["--engine", "deepspeed", "--zero-stage", "1"],
    "zero3": ["--engine", "deepspeed", "--zero-stage", "3"],
    "megatron-dp2": MEGATRON,
    "megatron-dp2-distopt": [*MEGATRON, "--use-distributed-optimizer"],
    "megatron-dp2-distopt-fp16": [*MEGATRON, "--use-distributed-optimizer", "--fp16", "--initial-loss-scale", "1024"],
    "megatron-pp2": [*MEGATRON, "--pipeline-model-parallel-size", "2"],
}
LAST = -1  # the poisoned rank: the last one computes the loss under pipeline parallelism too


def _setup(flags: list[str], cache: str):
    from megatron_slapo.arguments.parser import parse_args
    from megatron_slapo.training.run import setup

    argv = [*PARITY, "--schedule", "gpt_tp", "--lr-warmup-fraction", "0", *flags, "--data-cache-path", cache]
    return setup(parse_args("gpt", argv))  # no warmup: the first step taken has a learning rate


def _weights(run, directory: str) -> dict[str, torch.Tensor]:
    model = run.engine.state_dict(directory, include_optimizer=False)["model"]
    return {k: v.detach().clone() for k, v in model.items()}


class _Poisoned:
    """The run's task, but on the last rank the loss is multiplied by inf: every gradient there is
    inf or NaN, as after an fp16 overflow or a corrupt sample."""

    def __init__(self, task) -> None:
        self.task = task

    def inputs(self, batch):
        return self.task.inputs(batch)

    def criterion(self, out, batch):
        loss, metrics = self.task.criterion(out, batch)
        return (loss * math.inf if dist.get_rank() == dist.get_world_size() + LAST else loss), metrics

    def loss(self, model, batch):
        return self.criterion(model(**self.inputs(batch)), batch)


def _same_everywhere(value) -> bool:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


@pytest.mark.parametrize("flags", ENGINES.values(), ids=ENGINES.keys())
def test_a_poisoned_step_is_skipped_on_every_rank(flags, shared_tmp, request):
    run = _setup(flags, os.path.join(shared_tmp, "cache"))
    directory = os.path.join(shared_tmp, f"nonfinite-{request.node.callspec.id}")
    batches = random_batches(run, dist.get_rank())
    before = _weights(run, directory)
    poisoned = run.engine.train_step(batches, _Poisoned(run.task))
    after = _weights(run, directory)
    healthy = run.engine.train_step(batches, run.task)
    moved = _weights(run, directory)
    assert _same_everywhere((poisoned.skipped, healthy.skipped))
    assert poisoned.skipped and poisoned.grad_norm is None
    assert poisoned.overflow == ("--fp16" in flags)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not healthy.skipped and math.isfinite(healthy.grad_norm)
    assert any(not torch.equal(after[k], moved[k]) for k in after)


def test_distributed_optimizer_skips_on_an_overflow_only_one_shard_sees(shared_tmp):
    """One inf in the last rows of the word embeddings' gradient, on the last rank only. The
    gradient buffer holds parameters in reverse order, so those rows end it: after the
    reduce-scatter only the last data-parallel rank, which owns that shard, holds the inf."""
    run = _setup(MEGATRON[:2] + ["--use-distributed-optimizer"], os.path.join(shared_tmp, "cache"))
    directory = os.path.join(shared_tmp, "nonfinite-one-shard")
    wte = dict(run.engine.model.named_parameters())["stage.transformer.wte.weight"]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[-1, -1] = math.inf
        return grad

    handle = wte.register_hook(poison) if dist.get_rank() == dist.get_world_size() + LAST else None
    before = _weights(run, directory)
    result = run.engine.train_step(random_batches(run, dist.get_rank()), run.task)
    if handle:
        handle.remove()
    after = _weights(run, directory)
    assert _same_everywhere(result.skipped)
    assert result.skipped
    assert all(torch.equal(before[k], after[k]) for k in before)
