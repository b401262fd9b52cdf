"""Activation recomputation as Megatron-LM counts it (per pipeline stage), and what it saves."""

import argparse

import pytest
import torch

from megatron_slapo import parallel
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.training.recompute import recomputed_layers
from megatron_slapo.training.run import setup
from tests.test_bad_input import GPT, TRAIN, one_error_line

LAYERS = [f"h.{i}" for i in range(8)]


def flags(granularity=None, method="uniform", num_layers=1, ratio=None) -> argparse.Namespace:
    return argparse.Namespace(recompute_granularity=granularity, recompute_method=method,
                              recompute_num_layers=num_layers, checkpoint_ratio=ratio)  # fmt: skip


@pytest.mark.parametrize(
    "args, chunks, expected",
    [
        (flags(), 1, []),
        (flags("full"), 2, LAYERS),
        (flags("full", "block", 1), 1, ["h.0"]),
        (flags("full", "block", 1), 2, ["h.0", "h.4"]),  # the first layer of each stage, not of the model
        (flags("full", "block", 3), 2, ["h.0", "h.1", "h.2", "h.4", "h.5", "h.6"]),
        (flags("full", "block", 3), 4, LAYERS),  # more than a stage has: all of its layers, as Megatron
        (flags(ratio=0.5), 1, ["h.0", "h.1", "h.2", "h.3"]),
        (flags(ratio=0.5), 2, ["h.0", "h.1", "h.4", "h.5"]),
        (flags(ratio=0.3), 2, ["h.0", "h.4"]),  # round(0.3 x 4) = 1 per stage
        (flags(ratio=0.0), 2, []),
    ],
)
def test_layers_are_chosen_per_pipeline_stage(args, chunks, expected):
    assert recomputed_layers(args, LAYERS, chunks) == expected


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--recompute-granularity", "full", "--checkpoint-ratio", "0.5"], "--checkpoint-ratio and --recompute-gran"),
        (["--recompute-granularity", "full", "--recompute-num-layers", "2"], "uniform recomputes each layer"),
        (["--checkpoint-ratio", "1.5"], "--checkpoint-ratio 1.5 must lie between 0 and 1"),
    ],
)
def test_contradictory_recompute_flags_are_one_line(extra, message, capsys):
    sizes = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
    assert message in one_error_line("gpt", [*GPT, *sizes, *TRAIN, *extra], capsys)


def _saved_in_layers(flags_: list[str], capsys) -> tuple[int, int, str]:
    """Bytes autograd keeps for the backward while inside the transformer layers, and outside them,
    for one forward of the model the trainer builds; and what the trainer printed."""
    argv = [*GPT, "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            *TRAIN, "--micro-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0", *flags_]  # fmt: skip
    try:
        run = setup(parse_args("gpt", argv))
        model = run.engine.model
        inside, saved = [False], {True: {}, False: {}}
        for path in transformer_layers(model, 4):
            layer = model.get_submodule(path)
            layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
            layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[inside[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        tokens = torch.randint(0, 100, (4, 64), generator=torch.Generator().manual_seed(0))
        batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(4, 64)}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run.task.loss(model, batch)
    finally:
        parallel.destroy()
    return sum(saved[True].values()), sum(saved[False].values()), capsys.readouterr().out


def test_full_recompute_keeps_at_most_one_layer_in_l_of_the_activations(capsys):
    plain, outside, out = _saved_in_layers([], capsys)
    assert "activation recomputation" not in out
    full, outside_full, out = _saved_in_layers(["--recompute-granularity", "full"], capsys)
    assert "> activation recomputation: 4 of 4 transformer layers" in out
    b, s, h, layers, fp32 = 4, 64, 64, 4, 4
    assert full == layers * b * s * h * fp32  # each layer keeps its input, nothing else
    assert full <= plain / layers, (full, plain)
    assert outside_full == outside  # the embedding and the head keep what they kept
    block, _, out = _saved_in_layers(["--recompute-granularity", "full", "--recompute-method", "block",
                                      "--recompute-num-layers", "2"], capsys)  # fmt: skip
    assert "> activation recomputation: 2 of 4 transformer layers" in out
    assert full < block < plain


def test_selective_recompute_keeps_less_than_no_recompute_and_more_than_full(capsys):
    unfused = ["--attention-backend", "unfused"]  # the probabilities (b x heads x s x s) are then kept
    plain, outside, _ = _saved_in_layers(unfused, capsys)
    full, _, _ = _saved_in_layers([*unfused, "--recompute-granularity", "full"], capsys)
    selective, outside_selective, out = _saved_in_layers([*unfused, "--recompute-granularity", "selective"], capsys)
    assert "> activation recomputation: the attention core of 4 of 4 transformer layers, selective" in out
    assert full < selective < plain and outside_selective == outside
    b, s, heads, layers, fp32 = 4, 64, 4, 4, 4
    # The probabilities (b x heads x s x s per layer) are no longer kept; the core keeps its inputs:
    # q, k and v (views of the projection's output, kept anyway) and the mask (one for all layers).
    assert plain - selective == layers * b * heads * s * s * fp32 - b * s * s * fp32


def test_a_layer_shared_across_depths_is_described_with_them():
    """ALBERT: one layer module, run (and recomputed) at every depth."""
    import argparse

    from megatron_slapo.training.recompute import describe

    args = argparse.Namespace(recompute_granularity="full", recompute_method="uniform", checkpoint_ratio=None)
    assert describe(args, 1, 1, 1, depths=4) == (
        "> activation recomputation: 1 of 1 transformer layers (shared by 4 depths: every use recomputed), "
        "--recompute-granularity full --recompute-method uniform"
    )
    assert "shared" not in describe(args, 4, 4, 1, depths=4)
