"""The tuner's cheap plans give the figures the whole plans give, exactly: a run planned at one and
two layers a stage and extended to its depth (estimates/layer_extrapolation.py), and runs that
differ only in their ZeRO stage sharing one meta pass (estimate.STATE_FLAGS); runs where an
extension would be wrong are planned whole."""

import contextlib
import dataclasses
import io
import json

import pytest

from megatron_slapo.errors import ConfigError
from megatron_slapo.estimates import estimate as planner
from megatron_slapo.estimates.estimate import model_argv
from megatron_slapo.estimates.layer_extrapolation import shallow_explain
from tools.explain import explain

GPT = ["--schedule", "gpt_tp", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--micro-batch-size", "2", "--global-batch-size", "16", "--num-workers", "0"]  # fmt: skip
WORLD = 8


def _plan(argv: list[str]) -> list:
    with contextlib.redirect_stdout(io.StringIO()):
        return explain("gpt", argv, WORLD)


def _figures(estimates: list) -> list[dict]:
    """Every field but the schedule's text (the shallow run's)."""
    return [{k: v for k, v in dataclasses.asdict(e).items() if k != "schedule"} for e in estimates]


def _whole(argv: list[str]) -> list:
    planner._plans.clear()  # planned afresh, nothing shared with a shallow plan
    return _plan(argv)


@pytest.mark.parametrize(
    "layout",
    [
        ["--num-layers", "8", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--num-layers", "12", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3",
         "--sequence-parallel", "--tensor-model-parallel-size", "2"],
        ["--num-layers", "8", "--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--use-distributed-optimizer"],
        ["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--recompute-granularity", "selective",
         "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ],
    ids=["tp2-pp2", "pp2-interleaved-sp", "pp1-full-recompute-zero1", "pp2-selective"],
)  # fmt: skip
def test_a_run_extended_from_its_shallow_plans_has_the_whole_plans_figures(layout, tmp_path):
    argv = [*GPT, *layout, "--data-cache-path", str(tmp_path / "cache")]
    shallow = shallow_explain(argv, _plan)
    assert shallow is not None, "the extension applies to this run"
    assert _figures(shallow) == _figures(_whole(argv))


def test_a_model_whose_config_lists_its_layers_is_planned_whole(tmp_path):
    """A config that lists its layers one by one (``layer_types``: they may differ) is not
    extended; a plain config of the same depth is, and matches its whole plan."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 64}  # fmt: skip
    plain, uneven = tmp_path / "plain", tmp_path / "uneven"
    for folder, extra in ((plain, {}), (uneven, {"layer_types": ["full_attention"] * 8})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    run = ["--schedule", "llama_tp", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-workers", "0",
           "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    shallow = shallow_explain([*run, "--hf-config", str(plain)], _plan)
    assert shallow is not None
    assert _figures(shallow) == _figures(_whole([*run, "--hf-config", str(plain)]))
    assert shallow_explain([*run, "--hf-config", str(uneven)], _plan) is None
    for other in ({"model_type": "deepseek_v3"}, {"model_type": "qwen3", "use_sliding_window": True}):
        folder = tmp_path / other["model_type"]  # unlike layers a scalar decides (dense first, sliding some)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, **other}))
        assert shallow_explain([*run, "--hf-config", str(folder)], lambda _: pytest.fail("planned whole")) is None


@pytest.mark.parametrize(
    "extra",
    [
        ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
        ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
        ["--num-layers-per-virtual-pipeline-stage", "3"],
        ["--engine", "deepspeed", "--zero-stage", "3"],
        ["--checkpoint-ratio", "0.5"],
        ["--model-type", "qwen3_moe", "--num-experts", "4"],
        ["--pipeline-model-parallel-size=x"],
    ],
    ids=["block-recompute", "uniform-2-layers", "virtual-stages-not-dividing", "zero3", "checkpoint-ratio",
         "moe-family", "bad-flag"],
)  # fmt: skip
def test_runs_whose_figures_do_not_grow_by_whole_layers_are_planned_whole(extra):
    argv = [*GPT, "--num-layers", "8", "--pipeline-model-parallel-size", "2", *extra]
    assert shallow_explain(argv, lambda _: pytest.fail("nothing is planned")) is None


def test_shallow_plans_whose_growth_differs_by_rank_are_planned_whole():
    """The check itself, on made-up estimates: two ranks whose added layer costs differ."""
    one = _plan([*GPT, "--num-layers", "2", "--pipeline-model-parallel-size", "2"])
    two = [dataclasses.replace(e, flops=e.flops * (2 + i)) for i, e in enumerate(one)]
    calls = iter([one, two])
    assert (
        shallow_explain([*GPT, "--num-layers", "6", "--pipeline-model-parallel-size", "2"], lambda _: next(calls))
        is None
    )


def test_a_shallow_run_refused_leaves_the_run_to_be_planned_whole():
    asked = []

    def refused(argv):
        asked.append(argv)
        raise ConfigError("a rule on the depth")

    assert shallow_explain([*GPT, "--num-layers", "6", "--pipeline-model-parallel-size", "2"], refused) is None
    assert len(asked) == 1, "the shallow plan was asked for, and its refusal caught"


ZERO = [[], ["--use-distributed-optimizer"], ["--engine", "deepspeed", "--zero-stage", "2"],
        ["--engine=deepspeed", "--zero-stage=3"]]  # fmt: skip


def test_runs_that_differ_only_in_their_zero_stage_share_one_pass_and_keep_their_own_figures(tmp_path):
    base = [
        *GPT,
        "--num-layers",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--bf16",
        "--data-cache-path",
        str(tmp_path / "c"),
    ]
    planner._plans.clear()
    shared = [_plan([*base, *zero]) for zero in ZERO]
    assert len(planner._plans) == 1, "one pass for all four"
    assert [_figures(s) for s in shared] == [_figures(_whole([*base, *zero])) for zero in ZERO]
    assert len({json.dumps(_figures(s)[0]["memory"]) for s in shared}) == len(ZERO), "each counts its own state"


def test_a_shared_pass_still_checks_each_run():
    base = [*GPT, "--num-layers", "2", "--pipeline-model-parallel-size", "2"]
    _plan(base)
    with pytest.raises(Exception, match="pipeline parallelism needs --engine megatron"):
        _plan([*base, "--engine", "deepspeed", "--zero-stage", "1"])


def test_model_argv_drops_only_the_engines_state_flags():
    argv = ["--engine", "deepspeed", "--zero-stage", "3", "--use-distributed-optimizer", "--engine=megatron",
            "--num-layers", "2", "--engine", "fsdp"]  # fmt: skip
    assert model_argv(argv) == ("--num-layers", "2", "--engine", "fsdp")
