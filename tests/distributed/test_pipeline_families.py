"""Every decoder family in schedules/ trains under megatron-core's pipeline as one plain process does.

``test_engines.py`` covers GPT-2 (and BERT) in every layout; here GPT-Neo, OPT and Llama run
tensor parallelism, sequence parallelism, two pipeline stages (megatron engine, 1F1B) and
recompute, fp32, and must reproduce the single-process losses to 1e-5 over 10 steps. Llama is the
case that needs ``pipeline_inputs``: its rotary embedding is called with the hidden states, yet
its cos/sin derive from the position ids alone, so each stage recomputes them and only the hidden
state crosses the cut; its grouped-query attention keeps one key/value head per rank at TP2.
"""

import os

import pytest

from tests.distributed.runs import PARITY, assert_parity, layout_case, reference_losses, train_losses

TOLERANCE = 1e-5
FAMILIES = {  # two layers: one per pipeline stage
    "gpt_neo": ["--model-type", "gpt_neo", "--schedule", "gpt_neo_tp"],
    "opt": ["--model-type", "opt", "--schedule", "opt_tp"],
    "llama": ["--model-type", "llama", "--schedule", "llama_tp", "--num-query-groups", "2"],
}
PP2 = ["--engine", "megatron", "--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
ALL = ("gpt_neo", "opt", "llama")
LAYOUTS = {  # name -> (world sizes, extra flags, families)
    "tp2": ((2,), TP2, ALL),
    "pp2": ((2,), PP2, ALL),
    "tp2-pp2": ((4,), [*PP2, *TP2], ("llama",)),
    "tp2-sp": ((2,), [*TP2, "--sequence-parallel"], ALL),
    "tp2-pp2-sp": ((4,), [*PP2, *TP2, "--sequence-parallel"], ALL),
    # selective recompute reaches GPT-Neo's core through its _attn method, the others' through HF's interface
    "pp2-selective": ((2,), [*PP2, "--recompute-granularity", "selective"], ALL),
    "tp2-full-uniform": ((2,), [*TP2, "--recompute-granularity", "full", "--recompute-method", "uniform"], ("llama",)),
    "pp2-full-block": ((2,), [*PP2, "--recompute-granularity", "full", "--recompute-method", "block"], ("opt",)),
}


@pytest.fixture(scope="module")
def reference(shared_tmp, cache):
    """Single-process losses per family, run in one process."""
    return reference_losses(
        shared_tmp, lambda family: ("gpt", [*PARITY, *FAMILIES[family], "--data-cache-path", cache]), FAMILIES
    )


CASES = [layout_case(family, name, sizes, flags) for name, (sizes, flags, families) in LAYOUTS.items()
         for family in families]  # fmt: skip


@pytest.mark.parametrize("family, flags", CASES)
def test_pipeline_loss_parity_with_one_process(family, flags, reference, shared_tmp, cache, request):
    expected = reference(family)
    tb = os.path.join(shared_tmp, f"tb-family-{request.node.callspec.id}")
    losses = train_losses("gpt", [*PARITY, *FAMILIES[family], *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, expected, TOLERANCE)
