"""``--fp8-format`` trains at every layout as one process does: 10 steps of gpt_tp, llama_tp and
``--schedule auto`` (qwen3, qwen3_moe), against the same FP8 run in one process (emulated FP8,
bf16 around it), at TP2, TP2 with sequence parallelism, PP2, ZeRO-3 and FSDP2 over two
data-parallel ranks; and qwen3_moe's experts over two ranks, llama's and qwen3's sequence over two
ranks, GPT compiled at TP2 and on torch DDP's autocast at TP2, GPT and llama recomputing every
layer at TP2, with megatron-core's distributed optimizer over two ranks, and with FSDP2 gathering
the FP8 layers' weights in float8 (``--fp8-param-gather``).

The tolerance is bf16's relative precision, 2^-8 (the bound a bf16 run keeps to the fp32 one,
``test_mixed_precision.py``), and the ``bf16`` cases are held to it too. A layout reorders bf16
sums, so its losses drift from one process's by bf16 rounding; FP8 rounds what those sums feed, and
a rounding that flips moves a value by an FP8 step (6%) where bf16's moves it by 0.4%, so FP8
layouts drift further: measured, bf16's worst loss difference here is a few 1e-4 to 1e-3 and
FP8's up to 6e-3, at losses near 8 (the bound: 0.03). Losses cannot tell whether a split layer's
scales were agreed (that moves them less than the drift does): ``test_fp8.py`` checks the
agreement on the layers themselves, to 1e-5 against more than 1e-3 without it. Each run here is
checked to have run as many layers in FP8 as one process does.
"""

import os
import re

import pytest

from tests.distributed.runs import (
    PARITY,
    asked,
    assert_parity,
    first_rank_value,
    layout_case,
    reference_losses,
    train_losses,
)

TOLERANCE = 2**-8  # relative: bf16's precision, which a layout's losses keep to one process's, FP8 or not
MODELS = {
    "gpt": ["--schedule", "gpt_tp"],
    "llama": ["--model-type", "llama", "--schedule", "llama_tp", "--num-query-groups", "2"],
    "qwen3": ["--model-type", "qwen3", "--schedule", "auto", "--num-query-groups", "2"],
    "qwen3_moe": ["--model-type", "qwen3_moe", "--schedule", "auto", "--num-query-groups", "2", "--num-experts", "4",
                  "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"],
}  # fmt: skip
PRECISIONS = {
    "bf16": ["--bf16"],
    "fp8-tensorwise": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fp8-rowwise": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
}
# Each model's Linear layers in FP8: 2 layers of 4 (GPT-2: c_attn, c_proj, c_fc, mlp.c_proj) or 7 (q, k, v,
# o; gate, up, down); qwen3_moe's experts are grouped weights and its router stays: q, k, v, o only
LAYERS = {"gpt": 8, "llama": 14, "qwen3": 14, "qwen3_moe": 8}
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {  # name -> (flags, the models trained at it: None for all[, the precisions: all by default])
    "tp2": (TP2, None),
    "tp2-sp": ([*TP2, "--sequence-parallel"], None),
    "pp2": (["--engine", "megatron", "--pipeline-model-parallel-size", "2"], None),
    "zero3-dp2": (["--engine", "deepspeed", "--zero-stage", "3"], None),
    "fsdp-dp2": (["--engine", "fsdp"], None),
    "ep2": (["--expert-model-parallel-size", "2"], ("qwen3_moe",)),
    "cp2": (["--context-parallel-size", "2"], ("llama", "qwen3")),  # scales agreed over the sequence's ranks too
    "tp2-compile": ([*TP2, "--compile"], ("gpt",)),  # the agreement's collectives traced with the layer
    "tp2-recompute-full": ([*TP2, "--recompute-granularity", "full"], ("gpt", "llama")),  # FP8 recomputed alike
    "dp2-distopt": (["--engine", "megatron", "--use-distributed-optimizer"], ("gpt", "llama")),
    "tp2-ddp": (["--engine", "ddp", *TP2], ("gpt",)),  # autocast over fp32 weights: the operands cast first
    # the FP8 layers' weight shards all-gathered in float8 (torchao's; tensorwise scales only)
    "fsdp-dp2-fp8-gather": (["--engine", "fsdp", "--fp8-param-gather"], ("gpt", "llama"), ("fp8-tensorwise",)),
}
# The README's suite: each recipe, each model and each layout at least once; the rest in the slow tier
DEFAULT = {("gpt", "tp2-sp", "bf16"), ("qwen3_moe", "tp2", "bf16"), ("gpt", "tp2-sp", "fp8-tensorwise"), ("llama", "tp2", "fp8-rowwise"), ("qwen3_moe", "tp2", "fp8-tensorwise"),
           ("qwen3", "pp2", "fp8-rowwise"), ("gpt", "zero3-dp2", "fp8-rowwise"), ("llama", "fsdp-dp2", "fp8-tensorwise"),
           ("qwen3_moe", "ep2", "fp8-rowwise"), ("llama", "cp2", "fp8-tensorwise"),
           ("llama", "fsdp-dp2-fp8-gather", "fp8-tensorwise")}  # fmt: skip


def _argv(key: str) -> list[str]:
    model, precision = key.split("/")
    fast = ["--lr", "3e-3", "--min-lr", "3e-4"]  # a clear drop in 10 steps for every model
    return [*PARITY, *fast, *MODELS[model], *PRECISIONS[precision]]


CASES = [
    pytest.param(f"{model}/{precision}", flags, id=f"{model}-{layout}-{precision}",
                 marks=layout_case(model, layout, (2,), flags, slow=(model, layout, precision) not in DEFAULT).marks)
    for layout, (flags, models, *precisions) in LAYOUTS.items() for model in models or MODELS
    for precision in (precisions[0] if precisions else PRECISIONS)
]  # fmt: skip


@pytest.fixture(scope="module")
def reference(shared_tmp, cache, request):
    """One process's losses per model and precision, those this session's cases use computed together."""
    return reference_losses(
        shared_tmp, lambda key: ("gpt", [*_argv(key), "--data-cache-path", cache]), asked(request, "key")
    )


@pytest.mark.parametrize("key, flags", CASES)
def test_fp8_trains_at_each_layout_as_one_process(key, flags, reference, shared_tmp, cache, request, capsys):
    tb = os.path.join(shared_tmp, f"tb-fp8-{request.node.callspec.id}")
    losses = train_losses("gpt", [*_argv(key), *flags, "--data-cache-path", cache], tb)
    notes = first_rank_value(lambda: re.findall(r"^> FP8 \((.*)\): (\d+) Linear layers", capsys.readouterr().out, re.M))
    expected = reference(key)
    assert_parity(losses, expected, TOLERANCE * max(expected.values()))
    if "fp8" in key:  # the layout ran its layers in FP8, as many as one process does (MODELS' projections)
        recipe = key.split("-")[-1]
        assert [(how.split(",")[0], int(count)) for how, count in notes] == [
            (f"{recipe} scaling", LAYERS[key.split("/")[0]])
        ]
    else:
        assert notes == []
