"""--bf16 and --fp16 on the megatron engine as Megatron-LM means them: weights in that dtype, fp32
main weights in megatron-core's optimizer; gradients accumulated and reduced in fp32 (bf16; fp16
with --accumulate-allreduce-grads-in-fp32) or fp16; fp16 with megatron-core's loss scaler.
(Bit-exact resume: test_trainer.py.)"""

import os

import pytest
import torch

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.training.run import setup
from tests.distributed.runs import PARITY, TP2, last_rank_value, train_losses
from tests.utils import tb_scalars, tb_tags

RUN = [*PARITY, *TP2, "--engine", "megatron", "--lr-warmup-fraction", "0"]
PRECISIONS = {  # flags -> (weights, gradient buffers)
    "bf16": (["--bf16"], torch.bfloat16, torch.float32),
    "bf16-bf16-grads": (["--bf16", "--grad-reduce-in-bf16"], torch.bfloat16, torch.bfloat16),
    "fp16": (["--fp16"], torch.float16, torch.float16),
    "fp16-fp32-grads": (["--fp16", "--accumulate-allreduce-grads-in-fp32"], torch.float16, torch.float32),
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weights_are_half_and_the_optimizer_keeps_fp32_main_weights(cache, precision):
    flags, dtype, grad_dtype = PRECISIONS[precision]
    run = setup(parse_args("gpt", [*RUN, *flags, "--data-cache-path", cache]))
    try:
        engine = run.engine
        weights = [p for chunk in engine.chunks for p in chunk.parameters()]
        optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        main = [p for o in optimizers for group in o.optimizer.param_groups for p in group["params"]]
        grads = [p.main_grad for p in weights]
        report = engine.memory_report()
        scaler = optimizers[0].grad_scaler
    finally:
        run.reporter.close()
    assert weights and {p.dtype for p in weights} == {dtype}
    assert len(main) == len(weights) and {p.dtype for p in main} == {torch.float32}
    assert {g.dtype for g in grads} == {grad_dtype}
    count = sum(p.numel() for p in weights)  # 2-byte weights; fp32 main weights and two moments
    assert report == {"params": 2 * count, "grads": grad_dtype.itemsize * count, "optimizer": 12 * count}
    assert (type(scaler).__name__ if scaler else None) == ("DynamicGradScaler" if "--fp16" in flags else None)


@pytest.mark.parametrize("precision, tolerance", [("bf16", 2**-8), ("fp16", 2**-10)])
def test_half_precision_losses_follow_the_fp32_run(shared_tmp, cache, precision, tolerance):
    """20 steps: the model computes with half copies of the fp32 main weights, which keep every
    update, so the losses stay within the format's relative precision of the fp32 run's (bf16:
    8 bits of mantissa; fp16: 11, with a loss scale that never overflows here)."""
    argv = [*RUN, "--train-iters", "20", "--data-cache-path", cache]
    fp32 = train_losses("gpt", argv, os.path.join(shared_tmp, f"tb-{precision}-ref"))
    flags = [*PRECISIONS[precision][0], "--initial-loss-scale", "4096"]
    half = train_losses("gpt", [*argv, *flags], os.path.join(shared_tmp, f"tb-{precision}"))
    worst = max(abs(half[i] - fp32[i]) / fp32[i] for i in fp32)
    assert sorted(half) == sorted(fp32) == list(range(1, 21))
    assert worst < tolerance, (worst, fp32, half)
    assert fp32[20] < fp32[1] - 0.1 and half[20] < half[1] - 0.1


@pytest.mark.parametrize(
    "flags, scales",
    [  # megatron-core's DynamicGradScaler, reported after each step's update (as Megatron logs it)
        (["--hysteresis", "3", "--min-loss-scale", str(2**29)], [2**32, 2**32, 2**31, 2**30, 2**29, 2**29]),
        (["--initial-loss-scale", "1024", "--loss-scale-window", "2"], [1024, 2048, 2048, 4096, 4096, 8192]),
        (["--loss-scale", "512"], [512] * 6),
    ],
    ids=["overflows-hysteresis-min", "clean-window", "static"],
)
def test_fp16_loss_scale_follows_megatrons_flags(shared_tmp, cache, flags, scales):
    """From 2^32 every step overflows fp16: the first --hysteresis - 1 overflows keep the scale,
    then it halves down to --min-loss-scale, each step skipped; from 1024 nothing overflows and
    the scale doubles every --loss-scale-window steps; --loss-scale fixes it."""
    tb = os.path.join(shared_tmp, f"tb-fp16-scale-{len(flags)}-{flags[1]}")
    train_losses("gpt", [*RUN, "--fp16", "--train-iters", "6", *flags, "--data-cache-path", cache], tb)
    reported = last_rank_value(lambda: tb_scalars(tb, "loss-scale"))
    tags = last_rank_value(lambda: tb_tags(tb))
    assert reported == {i + 1: float(s) for i, s in enumerate(scales)}, reported
    assert ("grad-norm" in tags) == (scales[0] != 2**32)  # skipped steps log no gradient norm


@pytest.mark.parametrize("engine", ["megatron", "ddp"])
def test_a_constant_loss_scale_run_resumes_with_a_dynamic_scale(shared_tmp, cache, engine):
    """--loss-scale saves no scaler state; resuming without it starts the dynamic scale from its flags."""
    ck, tb = os.path.join(shared_tmp, f"ck-fp16-static-{engine}"), os.path.join(shared_tmp, f"tb-fp16-resume-{engine}")
    argv = [*PARITY, *TP2, "--engine", engine, "--fp16", "--save", ck, "--data-cache-path", cache]
    train_losses("gpt", [*argv, "--train-iters", "2", "--loss-scale", "512"], tb + "-a")
    train_losses("gpt", [*argv, "--train-iters", "3", "--load", ck, "--initial-loss-scale", "1024"], tb)
    assert last_rank_value(lambda: tb_scalars(tb, "loss-scale")) == {3: 1024.0}
