"""The run's settings are decided once, right after validation (training/settings.py): ``prepare``
reads them and writes nothing more into the arguments; the default schedule, the model type an HF
config gives and the sequence length taken from its positions are on the settings object."""

import copy

import pytest
import transformers

from megatron_slapo import parallel
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.training.plan import prepare
from megatron_slapo.training.settings import resolve_settings
from schedules import SCHEDULES, SINGLE_DEVICE, default_for

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0"]


@pytest.fixture
def qwen3(tmp_path) -> str:
    """A tiny qwen3 config: a family ``--schedule auto`` is the TP default for, with 48 positions."""
    transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=48).save_pretrained(tmp_path / "qwen3")  # fmt: skip
    return str(tmp_path / "qwen3")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> str:
    """One index cache for this module's runs on the embedded corpus: built once, not per test."""
    return str(tmp_path_factory.mktemp("cache"))


def _planned(task: str, argv: list[str], world: int):
    """``prepare`` of rank 0 of ``world`` (over the fake group), and the arguments as validation
    alone leaves them."""
    args = parse_args(task, argv)
    validated = copy.deepcopy(args)
    validate_args(validated, world)
    try:
        return prepare(args, world, simulate_rank=0), vars(validated)
    finally:
        parallel.destroy()


@pytest.mark.parametrize(
    "task, argv, world",
    [
        ("gpt", [*MOCK, *SIZES, *TRAIN], 1),
        ("gpt", [*MOCK, *TRAIN, "--hf-config", "QWEN3", "--tensor-model-parallel-size", "2"], 2),
        ("vision", ["--train-iters", "2", "--eval-iters", "0"], 1),
    ],
    ids=["size-flags", "hf-config", "vision"],
)
def test_prepare_writes_nothing_into_the_arguments_after_validation(task, argv, world, qwen3):
    plan, validated = _planned(task, [qwen3 if a == "QWEN3" else a for a in argv], world)
    assert vars(plan.args) == validated


def test_the_default_schedule_is_decided_once_on_the_settings(qwen3, capsys):
    plan, _ = _planned("gpt", [*MOCK, *TRAIN, "--hf-config", qwen3, "--tensor-model-parallel-size", "2"], 2)
    settings = plan.settings
    assert (settings.task, settings.model_type, settings.hf_source) == ("gpt", "qwen3", f"--hf-config {qwen3}")
    assert (settings.schedule, settings.schedule_given) == ("auto", False)
    assert settings.schedule_reason == "the default for qwen3 at --tensor-model-parallel-size 2"
    assert settings.seq_length == 48  # the config's positions: no --seq-length was given
    args = plan.args  # as given: no schedule, --model-type's default, no sequence length
    assert (args.schedule, args.model_type, args.seq_length) == (None, "gpt2", None)
    out = capsys.readouterr().out
    assert f"\n  schedule {'.' * 40} auto\n" in out and f"\n  model_type {'.' * 38} qwen3\n" in out  # the dump
    assert " > schedule: auto (the default for qwen3 at --tensor-model-parallel-size 2)\n" in out
    recorded = plan.recorded  # the checkpoint's record of the arguments: what the run used
    assert (recorded["schedule"], recorded["model_type"], recorded["seq_length"]) == ("auto", "qwen3", 48)
    assert (recorded["num_layers"], recorded["hidden_size"], recorded["num_attention_heads"]) == (2, 64, 4)
    assert (recorded["true_vocab_size"], recorded["padded_vocab_size"]) == (300, 300)  # the model's rows split


def test_a_schedule_given_is_the_schedule_and_an_unknown_one_is_refused():
    args = parse_args("gpt", [*MOCK, *SIZES, *TRAIN, "--schedule", "gpt_tp"])
    validate_args(args, 1)
    settings, hf_config = resolve_settings(args)
    assert hf_config is None and (settings.schedule, settings.schedule_reason) == ("gpt_tp", "--schedule")
    args = parse_args("gpt", [*MOCK, *SIZES, *TRAIN])
    validate_args(args, 1)
    settings, _ = resolve_settings(args)
    assert (settings.schedule, settings.schedule_given, settings.model_type) == ("default", False, "gpt2")
    args = parse_args("gpt", [*MOCK, *SIZES, *TRAIN, "--schedule", "nope"])
    validate_args(args, 1)
    with pytest.raises(ValueError, match="unknown schedule 'nope'"):
        resolve_settings(args)


def test_without_schedule_tensor_parallelism_gets_the_family_s_own_schedule():
    expected = {"gpt2": "gpt_tp", "llama": "llama_tp", "gpt_neo": "gpt_neo_tp", "opt": "opt_tp", "bert": "bert_tp",
                "roberta": "bert_tp", "albert": "bert_tp", "t5": "t5_tp", "wideresnet": "wideresnet_tp"}  # fmt: skip
    assert {t: default_for(t, 2) for t in expected} == expected
    assert {default_for(t, 1) for t in expected} == {"default"}  # TP 1: nothing to split
    assert default_for("qwen3", 2) == default_for("mixtral", 4) == "auto"  # verified, nothing written by hand
    assert default_for("qwen3", 1) == "default"
    assert default_for("codegen", 2) == "default"  # auto is not verified on it: check_schedule refuses it
    # every hand-written tensor-parallel schedule is some family's default; gpt_fused (one device) is none's
    defaults = {default_for(t, 2) for mod in SCHEDULES.values() if mod.MODEL_TYPES for t in mod.MODEL_TYPES}
    assert defaults == set(SCHEDULES) - SINGLE_DEVICE and "gpt_fused" in SINGLE_DEVICE


@pytest.mark.parametrize(
    "task, extra, schedule, model_type",
    [
        ("gpt", [], "gpt_tp", "gpt2"),
        ("gpt", ["--model-type", "llama"], "llama_tp", "llama"),
        ("bert", [], "bert_tp", "bert"),
        ("bert", ["--model-type", "albert"], "bert_tp", "albert"),
        ("t5", [], "t5_tp", "t5"),
        ("vision", [], "wideresnet_tp", "wideresnet"),
    ],
)
def test_tensor_parallel_without_schedule_plans_the_family_s_schedule(task, extra, schedule, model_type, data_cache,
                                                                       capsys):  # fmt: skip
    """What ``torchrun --nproc_per_node 2 pretrain_<task>.py --tensor-model-parallel-size 2`` plans (rank 0,
    over the fake group): the family's schedule, printed with why, and something sharded. BERT and T5
    read the embedded corpus (``--mock-data`` is GPT's alone)."""
    flags = {"gpt": [*MOCK, *SIZES, *TRAIN], "vision": []}.get(task, [*SIZES, "--data-cache-path", data_cache])
    argv = [*flags, *extra, "--tensor-model-parallel-size", "2", "--train-iters", "2", "--eval-iters", "0"]
    plan, _ = _planned(task, argv, 2)
    settings = plan.settings
    assert (settings.schedule, settings.model_type, settings.schedule_given) == (schedule, model_type, False)
    assert any(node.metadata.shards for _, node in plan.sch.named_schedules())
    line = f" > schedule: {schedule} (the default for {model_type} at --tensor-model-parallel-size 2)\n"
    assert line in capsys.readouterr().out
