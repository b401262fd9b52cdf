"""--bf16 on the megatron engine as Megatron-LM means it: bf16 weights, fp32 main weights in the
optimizer, gradients accumulated and reduced in fp32. (Bit-exact resume: test_trainer.py.)"""

import os

import torch

from megatron_slapo.training.arguments import parse_args
from megatron_slapo.training.loop import setup
from tests.distributed.runs import PARITY, TP2, train_losses

RUN = [*PARITY, *TP2, "--engine", "megatron", "--lr-warmup-fraction", "0"]


def test_weights_are_bf16_and_the_optimizer_keeps_fp32_main_weights(cache):
    run = setup(parse_args("gpt", [*RUN, "--bf16", "--data-cache-path", cache]))
    try:
        engine = run.engine
        weights = [p for chunk in engine.chunks for p in chunk.parameters()]
        optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        main = [p for o in optimizers for group in o.optimizer.param_groups for p in group["params"]]
        grads = [p.main_grad for p in weights]
        report = engine.memory_report()
    finally:
        run.reporter.close()
    assert weights and {p.dtype for p in weights} == {torch.bfloat16}
    assert len(main) == len(weights) and {p.dtype for p in main} == {torch.float32}
    assert {g.dtype for g in grads} == {torch.float32}
    count = sum(p.numel() for p in weights)  # bf16 weights; fp32 gradients, main weights and two moments
    assert report == {"params": 2 * count, "grads": 4 * count, "optimizer": 12 * count}


def test_bf16_losses_follow_the_fp32_run(shared_tmp, cache):
    """20 steps: the model computes with bf16 copies of the fp32 main weights, which keep every
    update, so the losses stay within bf16's relative precision (2^-8) of the fp32 run's."""
    argv = [*RUN, "--train-iters", "20", "--data-cache-path", cache]
    fp32 = train_losses("gpt", argv, os.path.join(shared_tmp, "tb-bf16-ref"))
    bf16 = train_losses("gpt", [*argv, "--bf16"], os.path.join(shared_tmp, "tb-bf16"))
    worst = max(abs(bf16[i] - fp32[i]) / fp32[i] for i in fp32)
    assert sorted(bf16) == sorted(fp32) == list(range(1, 21))
    assert worst < 2**-8, (worst, fp32, bf16)
    assert fp32[20] < fp32[1] - 0.1 and bf16[20] < bf16[1] - 0.1
