"""The model's flags from the checkpoint a run loads (Megatron's ``--use-checkpoint-args``): what the
checkpoint supplies, what a flag given keeps, and the one line when the two contradict, in the trainer
and in tools/explain.py alike (the bad-input table, tests/test_bad_input.py, has more refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_slapo import parallel
from megatron_slapo.arguments.checkpoint_args import take_model_flags
from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.loop import pretrain
from tests.test_bad_input import one_error_line
from tools import explain

MOCK = ["--mock-data", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0",
        "--log-interval", "1"]  # fmt: skip
TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
LLAMA = ["--model-type", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "48", "--seq-length", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A Llama of grouped-query attention and its own FFN width, trained 2 iterations on mock data."""
    ck = tmp_path_factory.mktemp("llama") / "ck"
    pretrain("gpt", [*MOCK, *TOKENIZER, *LLAMA, "--train-iters", "2", "--save", str(ck)])
    parallel.destroy()
    return ck


def test_load_alone_resumes_the_model_of_the_checkpoint(llama, tmp_path, capsys):
    """No size flag, no tokenizer flag: the family, its sizes, the sequence length and the tokenizer
    of the run that saved it."""
    state = pretrain("gpt", [*MOCK, "--load", str(llama), "--save", str(tmp_path / "next")])
    parallel.destroy()
    out = capsys.readouterr().out
    assert state.iteration == 3 and f"loaded checkpoint {llama}/iter_0000002 at iteration 2" in out
    assert (f"the model's flags from the checkpoint in --load {llama}: --model-type llama --num-layers 2 --hidden-size "
            "32 --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 48 --seq-length 16 "
            "--max-position-embeddings 16 --tokenizer-type NullTokenizer --vocab-size 100") in out  # fmt: skip


def test_a_size_flag_given_shapes_the_model_unless_checkpoint_args_are_asked_for(llama, capsys):
    """As Megatron: a size flag given, the others are required; with --use-checkpoint-args they come
    from the checkpoint, and the one given must agree with it (the same tensors, other heads)."""
    argv = [*MOCK, "--load", str(llama), "--num-attention-heads", "8"]
    assert "--num-layers, --hidden-size and --seq-length are required" in one_error_line("gpt", argv, capsys)
    assert one_error_line("gpt", [*argv, "--use-checkpoint-args"], capsys) == (
        f"{llama}/iter_0000002 holds a model of 4 attention heads, this run builds 8: give --num-attention-heads 4, "
        "or another --load"
    )


def test_another_family_of_the_same_tensors_is_refused(llama, capsys):
    """Mistral's tensors are Llama's, name for name and shape for shape: only the record tells them apart."""
    argv = [*MOCK, "--load", str(llama), "--use-checkpoint-args", "--model-type", "mistral", "--finetune"]
    assert one_error_line("gpt", argv, capsys) == (f"{llama}/iter_0000002 holds a llama model, this run builds mistral: "
                                            "give --model-type llama, or another --load")  # fmt: skip


@pytest.mark.parametrize("layout, note", [([], "same layout"), (["--tensor-model-parallel-size", "2"], "resharding")])
def test_explain_plans_the_model_of_the_checkpoint(layout, note, llama, capsys):
    explain.main(["--load", str(llama), *MOCK, *layout])
    out = capsys.readouterr().out
    assert f"the model's flags from the checkpoint in --load {llama}: --model-type llama --num-layers 2" in out
    assert "LlamaForCausalLM: tensor-parallel rank 0" in out
    assert f"Checkpoint to load: {llama}/iter_0000002 (torch_dist): saved at TP1 x PP1 x DP1, megatron; " in out
    assert out.rstrip().endswith(f"({note})"), out[-500:]


def test_a_checkpoint_an_hf_config_shaped_gives_that_config_instead_of_the_embedded_shape():
    args = parse_args("gpt", [])  # the embedded run: its defaults are not the user's
    taken = take_model_flags(args, {"task": "gpt", "load_hf": "hf/gpt", "num_layers": 1}, "ck")
    assert taken == ["--hf-config ck"] and args.hf_config == "ck"
    assert args.num_layers is args.seq_length is None and "num_layers" not in args.embedded_defaults


def test_a_given_model_type_stays_and_a_checkpoint_of_another_trainer_is_refused():
    args = parse_args("gpt", ["--model-type", "mistral", "--use-checkpoint-args", "--load", "ck"])
    assert take_model_flags(args, {"task": "gpt", "model_type": "llama", "num_layers": 3}, "ck") == ["--num-layers 3"]
    assert (args.model_type, args.num_layers, args.checkpoint_defaults) == ("mistral", 3, {"num_layers": 3})
    with pytest.raises(ConfigError, match="^--load ck holds a checkpoint of pretrain_gpt.py, not of pretrain_bert.py"):
        take_model_flags(parse_args("bert", ["--load", "ck"]), {"task": "gpt"}, "ck")


def test_a_t5_checkpoint_s_recorded_positions_are_not_refused_as_the_user_s():
    """Validation fills --max-position-embeddings in from --seq-length, so a T5 checkpoint records
    it; taken back on --load, it is the checkpoint's value, not a flag T5 cannot take from the user."""
    from megatron_slapo.arguments.validation import validate_args

    saved = parse_args("t5", [])  # the embedded run, as it records itself
    validate_args(saved, 1)
    assert saved.max_position_embeddings is not None
    args = parse_args("t5", ["--load", "ck"])
    taken = take_model_flags(args, {"task": "t5", **vars(saved)}, "ck")
    assert f"--max-position-embeddings {saved.max_position_embeddings}" in taken
    validate_args(args, 1)  # not refused
    given = parse_args("t5", ["--load", "ck", "--max-position-embeddings", "64"])
    with pytest.raises(ConfigError, match="--max-position-embeddings 64: t5 has no position embeddings"):
        validate_args(given, 1)
