"""A family no schedule is verified on is refused, where the run needs its model split, in one line
that says what stops ``--schedule auto`` on it and what to do instead (schedules/refusal.py); a
width the size flags set indirectly is blamed on the flag that set it (arguments/widths.py).

Each run plans rank 0 of two in this process (``tools/explain.py``, the trainer's own checks over
a fake process group). The families are ones ``--schedule auto`` is not meant to cover in this
version, one for each kind of refusal: a plan style it does not follow, a module it refuses, a
config without a plan, and a plan that runs but has not been checked against the model.
"""

import re
from pathlib import Path

import pytest

from megatron_slapo.errors import ConfigError
from schedules import check_fits, verified
from schedules.refusal import WRITING_A_SCHEDULE
from tools import explain

BASE = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
        "--train-iters", "1", "--lr", "1e-3"]  # fmt: skip
TP2 = ["--world-size", "2", "--tensor-model-parallel-size", "2"]
EXPERTS = ["--num-experts", "4", "--moe-router-topk", "2"]
DOCS = "write a schedule for {} (docs/schedules.md)"


def error_line(capsys: pytest.CaptureFixture, *flags: str) -> str:
    """The one error line of explain.py for ``flags`` (the trainer's checks at that layout)."""
    with pytest.raises(SystemExit) as exit_:
        explain.main([*BASE, *flags])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("explain.py: error: ")
    return lines[0].removeprefix("explain.py: error: ")


def assert_remedies(message: str, family: str, resets: str) -> None:
    """Every remedy in ``message``, each with the flags that make the layout one it runs: the model
    whole (``--schedule default`` only with ``resets``), a data-parallel engine, a schedule of one's own."""
    whole = re.findall(r"data-parallel \(([^)]*)\)", message)
    assert whole == [f"{resets}--schedule default"], whole
    assert f"instead ({resets}--engine fsdp, or --engine deepspeed --zero-stage 3)" in message
    assert message.endswith(DOCS.format(family))
    assert "use default" not in message and "schedules that fit" not in message


@pytest.mark.parametrize(
    "family, flags, stops",
    [
        # a plan style auto does not follow: GraniteMoE-SWA's attention-local parameters
        ("granitemoe_swa", EXPERTS, "cannot run it: granitemoe_swa plans 'layers.*.self_attn' as 'local_params', "
         "which it cannot honour yet"),
        # a module auto refuses: Nemotron-H's experts, with separate up and down weights
        ("nemotron_h", [*EXPERTS, "--moe-ffn-hidden-size", "32"], "cannot run it: [model.layers.1.mixer.experts] NemotronHExperts: expected gated "
         "experts with a packed gate_up_proj weight"),
        # no plan at all
        ("falcon", [], "cannot run it: the falcon config publishes no base_model_tp_plan to follow"),
        # a plan that runs, and splits only the embedding (and the LM head auto adds)
        ("lfm2", [], "(its plan runs, but is not checked against the unscheduled model: it splits only the embedding "
         "and the LM head)"),
    ],
    ids=["style", "module", "no-plan", "runs-unverified"],
)  # fmt: skip
def test_an_unverified_family_at_tp2_is_told_what_stops_auto_and_what_to_do(family, flags, stops, capsys):
    assert not verified(family)
    message = error_line(capsys, *TP2, "--model-type", family, *flags)
    assert message.startswith(f"--tensor-model-parallel-size 2 needs a schedule that splits {family}: --schedule auto "
                              f"has not verified {family} yet")  # fmt: skip
    assert stops in message
    assert_remedies(message, family, "--tensor-model-parallel-size 1 ")


def test_auto_named_at_tp1_and_expert_parallelism_are_refused_alike(capsys):
    """``--schedule auto`` named at TP 1 (where default runs as it is), expert parallelism without
    tensor parallelism, which needs the flag set back, and a pipeline (whole on every rank: PP 1
    too); a schedule written for another family is named as such."""
    message = error_line(capsys, "--world-size", "1", "--model-type", "lfm2", "--schedule", "auto")
    assert message.startswith("--schedule auto has not verified lfm2 yet (its plan runs")
    assert_remedies(message, "lfm2", "")
    message = error_line(capsys, "--world-size", "2", "--expert-model-parallel-size", "2", "--model-type", "jamba",
                         *EXPERTS)  # fmt: skip
    assert message.startswith("--expert-model-parallel-size 2 needs a schedule that splits jamba")
    assert "each layer's feed_forward" in message  # the experts placed on their ranks
    assert_remedies(message, "jamba", "--expert-model-parallel-size 1 ")
    message = error_line(capsys, "--world-size", "4", "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--model-type", "lfm2")  # fmt: skip
    assert_remedies(message, "lfm2", "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 ")
    message = error_line(capsys, *TP2, "--model-type", "falcon", "--schedule", "llama_tp")
    assert message.startswith("--schedule llama_tp is for llama models, not falcon, and --tensor-model-parallel-size 2")
    assert_remedies(message, "falcon", "--tensor-model-parallel-size 1 ")


def test_check_fits_refuses_auto_on_an_unverified_family_without_a_model():
    """What tools/convert_checkpoint.py checks before any process group: no model to ask auto
    about, the remedies at the tensor-parallel size 1."""
    with pytest.raises(ConfigError) as refused:
        check_fits("auto", "lfm2")
    assert str(refused.value).startswith("--schedule auto has not verified lfm2 yet. What you can do")
    assert_remedies(str(refused.value), "lfm2", "--tensor-model-parallel-size 1 ")
    assert (Path(__file__).resolve().parents[1] / WRITING_A_SCHEDULE).is_file()  # the page the refusal points to
    with pytest.raises(ConfigError, match="--schedule auto is for .* models, not gpt2; schedules that fit gpt2: "):
        check_fits("auto", "gpt2")  # a family with a schedule of its own is told which fit, as before


def test_a_width_the_size_flags_derive_is_blamed_on_the_flag_that_set_it(capsys):
    """qwen3_next's experts (and shared experts) are 512/5632 of its FFN: 4 x --hidden-size 64 gives
    them 23 features each, which TP 2 cannot split. The error names --hidden-size, how, and the
    flags that set the widths directly; widths the flags gave keep the plain error."""
    how = "4 x it = 256 without --ffn-hidden-size, x 512 / 5632: qwen3_next's proportions"
    expected = "; ".join(
        f"--hidden-size 64 gives the {what} 23 ({how}), which --tensor-model-parallel-size 2 does not divide: give "
        f"{flag} (a multiple of 2)"
        for what, flag in (("experts' FFN hidden size", "--moe-ffn-hidden-size"),
                           ("shared experts' FFN hidden size", "--moe-shared-expert-intermediate-size"))
    )  # fmt: skip
    moe = ["--model-type", "qwen3_next", "--num-experts", "4", "--moe-router-topk", "2"]
    assert error_line(capsys, *TP2, *moe) == expected
    message = error_line(capsys, *TP2, *moe, "--ffn-hidden-size", "253", "--moe-shared-expert-intermediate-size", "32")
    assert message == ("--tensor-model-parallel-size 2 does not divide the 253 FFN hidden size; --ffn-hidden-size 253 "
                       "gives the experts' FFN hidden size 23 (x 512 / 5632: qwen3_next's proportions), which "
                       "--tensor-model-parallel-size 2 does not divide: give --moe-ffn-hidden-size (a multiple of 2)")  # fmt: skip
    message = error_line(
        capsys, *TP2, *moe, "--moe-ffn-hidden-size", "23", "--moe-shared-expert-intermediate-size", "32"
    )
    assert message == "--tensor-model-parallel-size 2 does not divide the 23 experts' FFN hidden size"
