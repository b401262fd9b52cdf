"""DeepSpeed's sharded state (what ``--ckpt-format torch_dist`` saves of the engine) on two
data-parallel ranks, at every ZeRO stage: each rank's runs are the right elements of the fp32
weights, nothing outside them is needed, and a snapshot loaded into a fresh engine of the same
layout continues the training exactly (weights, moments, step count, LR schedule). And the fp16
loss scale, which DeepSpeed cannot train with on a CPU, converts between DeepSpeed's scaler and
megatron-core's form.

Engines are built directly (a tiny GPT-2, random tokens), four per case, in one launch: DeepSpeed's
import is the cost, the cases take one to four seconds each.
"""

from __future__ import annotations

import argparse
import copy
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers
from megatron.core import parallel_state

import megatron_slapo as ms
from megatron_slapo import parallel
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.engines.base import ModelShape
from megatron_slapo.engines.deepspeed_state import grad_scaler_state, load_grad_scaler_state
from megatron_slapo.engines.deepspeed_zero import DeepSpeedEngine
from megatron_slapo.engines.loss_scaler import load_scaler_state, loss_scaler_for
from megatron_slapo.engines.sharded_state import WEIGHT, EngineState, Fill
from megatron_slapo.training.tasks import GPTTask
from tests.distributed.conftest import use_layout
from tests.utils import tiny_gpt2_config

# The engine-level round trips; the trainer's resumes at another layout are test_engines.py's (one
# process's checkpoint at ZeRO-3, among others) and tests/test_reshard.py's (launches, in the slow tier).
# The README's suite runs DEFAULT's case; CI's slow tier the others (through tests/test_distributed.py's
# slow launch).

# An odd hidden size: parameters of odd length, so that ZeRO-3 pads its last partitions and
# ZeRO-1/2's flat partitions split parameters at odd offsets.
CONFIG = {"n_embd": 33, "n_head": 3, "vocab_size": 127, "n_positions": 32}
FLAGS = ["--num-layers", "2", "--hidden-size", "33", "--num-attention-heads", "3", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-2",
         "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "127", "--engine", "deepspeed"]  # fmt: skip
CASES = [(0, []), (0, ["--bf16"]), (1, []), (2, []), (2, ["--bf16"]), (3, []), (3, ["--bf16"])]
DEFAULT = (2, [])  # the README's suite's case: flat partitions cut parameters at odd offsets


def _engine(stage: int, flags: list[str], seed: int) -> DeepSpeedEngine:
    args = parse_args("gpt", [*FLAGS, "--zero-stage", str(stage), *flags])
    validate_args(args, dist.get_world_size())
    dp, tp = parallel_state.get_data_parallel_group(), parallel.tensor_parallel_group()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config(**CONFIG))
    model = ms.build(ms.create_schedule(model), seed=seed, after_unit=DeepSpeedEngine.build_hook(args, dp, tp))
    return DeepSpeedEngine(model, args, dp, tp, ModelShape(2, 33, 3))


def _batch(step: int) -> list[dict[str, torch.Tensor]]:
    """This rank's one micro-batch of global step ``step`` (the same for every engine)."""
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(
        100 * step + dist.get_rank()))  # fmt: skip
    return [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}]


def _train(engine: DeepSpeedEngine, steps: range) -> list[float]:
    task = GPTTask(CONFIG["vocab_size"], parallel.tensor_parallel_group())
    return [float(engine.train_step(_batch(s), task).metrics["lm loss"]) for s in steps]


def _eval(engine: DeepSpeedEngine) -> float:
    return engine.eval_step(_batch(9), GPTTask(CONFIG["vocab_size"], parallel.tensor_parallel_group()))["lm loss"]


def _snapshot(state: EngineState) -> tuple[dict, dict]:
    """Every run's values, by (first name, state, start), and the scalars: a checkpoint in memory."""
    runs = {(p.names[0], k, r.start): r.data.detach().clone() for p in state.params for k, r in p.tensors.items()}
    return runs, copy.deepcopy(state.scalars)


def _fill(snapshot: tuple[dict, dict], asked: list, moments_scale: float = 1.0) -> Fill:
    """Copies the snapshot into the runs it is given (recording their keys in ``asked``); with
    ``moments_scale``, AdamW's moments scaled by it: a wrong state, which the training must show."""
    runs, scalars = snapshot

    def fill(state: EngineState) -> None:
        for p in state.params:
            for k, r in p.tensors.items():
                asked.append((p.names[0], k, r.start))
                r.data.copy_(runs[asked[-1]] * (1.0 if k == WEIGHT else moments_scale))
        state.scalars = copy.deepcopy(scalars)

    return fill


def _misplaced_runs(engine: DeepSpeedEngine, rounded: torch.dtype) -> list[str]:
    """Runs whose elements are not those of the whole fp32 weight at their place (compared in
    ``rounded``), and weights whose runs on the two ranks together do not cover them exactly once
    (ZeRO-1-3) or whole (stage 0)."""
    full = engine.full_state_dict()  # DeepSpeed's own gathering of the fp32 masters
    state = engine.sharded_state()
    bad, spans = [], {}
    for p in state.params:
        flat = full[p.names[0]].view(-1)
        for k, r in p.tensors.items():
            spans.setdefault((p.names[0], k), []).append((r.start, r.data.numel()))
            held = flat[r.start : r.start + r.data.numel()]
            if k == WEIGHT and not torch.equal(r.data.view(-1).cpu().to(rounded), held.to(rounded)):
                bad.append(f"{p.names[0]} at {r.start}")
    every: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(every, spans)
    for name, k in set().union(*every):
        runs = sorted({span for rank in every for span in rank.get((name, k), [])})
        ends = [start + n for start, n in runs]
        gaps = any(start != end for (start, _), end in zip(runs[1:], ends, strict=False))
        if runs[0][0] != 0 or ends[-1] != full[name].numel() or gaps:
            bad.append(f"{name}/{k} covered by {runs}")
    return bad


@pytest.mark.parametrize("stage,flags", [
    pytest.param(s, f, id=f"zero{s}{'-' if f else ''}{''.join(f)[2:]}", marks=[] if (s, f) == DEFAULT else [pytest.mark.slow])
    for s, f in CASES])  # fmt: skip
def test_a_snapshot_of_the_runs_resumes_the_same_training(stage, flags):
    """Engine A trains two steps; its runs and scalars are copied. B, another initialisation that
    has trained a step (ZeRO-3 keeps small weights gathered), loads the weights alone: its forward
    then equals A's. C, fresh, loads all of it: the next two steps' losses equal A's. D loads it
    with the moments scaled: its training differs (the moments are used)."""
    use_layout(1)
    a = _engine(stage, flags, seed=1)
    _train(a, range(2))
    # full_state_dict reads stage 0's bf16/fp16 weights, not their fp32 copies: the runs, rounded, equal them
    low = {"--bf16": torch.bfloat16, "--fp16": torch.float16}
    misplaced = _misplaced_runs(a, low[flags[0]] if stage == 0 and flags else torch.float32)
    snapshot = _snapshot(a.sharded_state())
    a_eval = _eval(a)
    b = _engine(stage, flags, seed=2)
    _train(b, range(1))
    b_eval_before = _eval(b)
    weights_asked, asked = [], []
    b.load_sharded_state(_fill(snapshot, weights_asked), load_optimizer=False)
    b_eval = _eval(b)
    c = _engine(stage, flags, seed=3)
    c.load_sharded_state(_fill(snapshot, asked))
    a_losses, c_losses = _train(a, range(2, 4)), _train(c, range(2, 4))
    d = _engine(stage, flags, seed=4)
    d.load_sharded_state(_fill(snapshot, [], moments_scale=4.0))
    wrong = _train(d, range(2, 4))

    assert not misplaced, misplaced
    # DeepSpeed's stage-0 bf16 optimizer steps once, on zero gradients, to create AdamW's state
    assert snapshot[1]["optimizer_step"] == (3.0 if stage == 0 and flags else 2.0)
    assert set(asked) == set(snapshot[0]), "the load asks for what the save gave"
    assert {k for k in weights_asked if k[1] != WEIGHT} == set(), "without the optimizer, only the weights"
    assert abs(b_eval_before - a_eval) > 1e-3, "B starts elsewhere, or the test proves nothing"
    assert b_eval == pytest.approx(a_eval, rel=1e-6, abs=0), "the loaded weights reach the forward"
    assert c_losses == pytest.approx(a_losses, rel=1e-6, abs=0), (c_losses, a_losses)
    assert abs(wrong[1] - a_losses[1]) > 1e-4, (wrong, a_losses)


@pytest.mark.slow
def test_the_fp16_loss_scale_converts_to_megatron_cores_and_back():
    """DeepSpeed's dynamic loss scaler and megatron-core's (growth after 3 clean steps, halving
    after 2 overflows, floor 1), after a random run of clean and overflowing steps on one,
    converted into the other, then fed the same steps: the same scale at every step up to the next
    overflow (after one, DeepSpeed waits a clean step longer than megatron-core to grow). Through
    megatron-core's form and back, DeepSpeed's scaler continues exactly, whatever follows.
    DeepSpeed has no fp16 on a CPU, so its scaler is driven alone, as its ZeRO optimizers do."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    _engine(1, [], seed=1)  # DeepSpeed's scaler logs through its communication backend, which this starts
    flags = argparse.Namespace(fp16=True, loss_scale=None, initial_loss_scale=2.0**8, min_loss_scale=1.0,
                               loss_scale_window=3, hysteresis=2)  # fmt: skip

    def deepspeed():  # as a ZeRO optimizer holds it
        return SimpleNamespace(loss_scaler=DynamicLossScaler(
            init_scale=2.0**8, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False,
            raise_error_at_min_scale=False))  # fmt: skip

    def deepspeed_scales(optimizer, overflows):
        return [optimizer.loss_scaler.update_scale(o) or optimizer.loss_scaler.cur_scale for o in overflows]

    def megatron_scales(scaler, overflows):
        return [scaler.update(found_inf=o) or float(scaler.scale) for o in overflows]

    rng, mismatches = random.Random(0), []
    for _ in range(100):
        before = [rng.random() < 0.3 for _ in range(rng.randrange(0, 12))]
        after = [rng.random() < 0.3 for _ in range(12)]
        until = after.index(True) + 1 if True in after else len(after)
        ds, megatron = deepspeed(), loss_scaler_for(flags)
        deepspeed_scales(ds, before)
        load_scaler_state(megatron, grad_scaler_state(ds))
        if deepspeed_scales(ds, after)[:until] != megatron_scales(megatron, after)[:until]:
            mismatches.append(("DeepSpeed to megatron-core", before, after))
        ds, megatron = deepspeed(), loss_scaler_for(flags)
        megatron_scales(megatron, before)
        load_grad_scaler_state(ds, megatron.state_dict())
        if deepspeed_scales(ds, after)[:until] != megatron_scales(megatron, after)[:until]:
            mismatches.append(("megatron-core to DeepSpeed", before, after))
        ds, resumed = deepspeed(), deepspeed()
        deepspeed_scales(ds, before)
        load_grad_scaler_state(resumed, grad_scaler_state(ds))
        if deepspeed_scales(ds, after) != deepspeed_scales(resumed, after):
            mismatches.append(("DeepSpeed to DeepSpeed", before, after))
    assert not mismatches, mismatches[:3]
