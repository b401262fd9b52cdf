"""Bad input to the entry points: one ``prog: error: ...`` line and exit status 2, before any compute.

Each case runs ``pretrain`` in this process: an exception other than the one-line exit (a
KeyError, a ZeroDivisionError, megatron-core's assertions) fails the test with its traceback.
"""

import pytest
import transformers

from megatron_slapo import parallel
from megatron_slapo.training.loop import pretrain
from schedules import auto

GPT = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0"]


@pytest.fixture(autouse=True)
def no_process_group_left():
    """Some refusals come after the (single-process) group starts: leave none to the next tests."""
    yield
    parallel.destroy()


def one_error_line(task: str, argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as exit_:
        pretrain(task, argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"pretrain_{task}.py: error: ")
    return err[0].removeprefix(f"pretrain_{task}.py: error: ")


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--micro-batch-size", "0", "--micro-batch-size 0 must be >= 1"),
        ("--train-iters", "0", "--train-iters 0 must be >= 1"),
        ("--train-iters", "-5", "--train-iters -5 must be >= 1"),
        ("--seq-length", "0", "--seq-length 0 must be >= 1"),  # was a SIGFPE on rank 0
        ("--num-attention-heads", "0", "--num-attention-heads 0 must be >= 1"),
        ("--make-vocab-size-divisible-by", "0", "--make-vocab-size-divisible-by 0 must be >= 1"),
        ("--hidden-dropout", "1.5", "--hidden-dropout 1.5 must lie between 0 and 1"),
    ],
)
def test_out_of_range_values_name_the_flag(flag, value, message, capsys):
    argv = [*GPT, *SIZES, *TRAIN, "--lr-decay-style", "constant", "--make-vocab-size-divisible-by", "128"]
    argv = _replace(argv, flag, value)
    assert one_error_line("gpt", argv, capsys) == message


def test_embedded_defaults_are_never_blamed_on_the_user(capsys):
    """With no data flags the embedded run picks --min-lr; a small --lr must not contradict it."""
    from megatron_slapo.training.arguments import parse_args

    args = parse_args("gpt", ["--lr", "1e-5", "--lr-warmup-iters", "3"])
    assert args.min_lr == pytest.approx(1e-6) and args.lr_warmup_fraction is None  # follow what was given
    assert one_error_line("gpt", ["--lr=-1e-3"], capsys) == "--lr -0.001 must be >= 0"  # not "--min-lr ... --lr"
    message = one_error_line("gpt", ["--max-position-embeddings", "64"], capsys)
    assert message == "--seq-length 128 (the embedded run's default) exceeds --max-position-embeddings 64"


def test_embedded_run_with_a_pretrained_model_keeps_its_shape(tmp_path):
    from megatron_slapo.training.arguments import parse_args

    args = parse_args("gpt", ["--load-hf", str(tmp_path)])
    assert args.seq_length is None and args.num_layers is None  # the checkpoint's, not the embedded run's
    assert args.train_iters == 200 and "seq_length" not in args.embedded_defaults


@pytest.mark.parametrize(
    "task, argv, message",
    [
        ("gpt", ["--schedule", "bert_tp"], "--schedule bert_tp is for bert, roberta and albert models, not gpt2; "
         "schedules that fit gpt2: default, gpt_tp, gpt_fused"),
        ("gpt", ["--schedule", "llama_tp"], "--schedule llama_tp is for llama models, not gpt2; "
         "schedules that fit gpt2: default, gpt_tp, gpt_fused"),
        ("bert", ["--schedule", "llama_tp", "--model-type", "albert"], "--schedule llama_tp is for llama models, "
         "not albert; schedules that fit albert: default, bert_tp"),
        ("gpt", ["--schedule", "auto"], f"--schedule auto is for {', '.join(auto.MODEL_TYPES[:-1])} and "
         f"{auto.MODEL_TYPES[-1]} models, not gpt2; schedules that fit gpt2: default, gpt_tp, gpt_fused"),
        ("gpt", ["--model-type", "bert"], "--model-type bert is an encoder: pretrain_gpt.py trains decoder-only "
         "models (for encoders use pretrain_bert.py)"),
        ("gpt", ["--model-type", "no_such_model"], "unknown --model-type 'no_such_model': give one of gpt2, gpt_neo, "
         "opt, llama or a transformers causal-LM model type (e.g. qwen3, mistral)"),
    ],
)  # fmt: skip
def test_a_schedule_for_another_model_family_says_which_fit(task, argv, message, capsys):
    assert one_error_line(task, [*GPT, *SIZES, *TRAIN, *argv], capsys) == message


def test_load_hf_of_a_missing_directory(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    argv = [*GPT, *TRAIN, "--load-hf", missing]
    assert one_error_line("gpt", argv, capsys) == (
        f"--load-hf {missing} is not a directory: give a directory written by save_pretrained "
        "(or convert_checkpoint.py to-hf)"
    )


@pytest.mark.parametrize(
    "task, config, message",
    [
        ("gpt", transformers.BertConfig(), "holds a bert model, which is not a causal LM"),
        ("gpt", transformers.T5Config(), "holds a t5 model, which is not a causal LM"),
        ("bert", transformers.GPT2Config(), "holds a gpt2 model, which is not a masked LM"),
    ],
)
def test_a_pretrained_model_of_the_wrong_kind_is_refused(task, config, message, tmp_path, capsys):
    """BERT loaded by pretrain_gpt.py would build a non-causal BertLMHeadModel and train next-token
    prediction on it; GPT-2 in pretrain_bert.py would train masked LM with a causal mask."""
    config.save_pretrained(tmp_path)
    assert message in one_error_line(task, [*GPT, *TRAIN, "--load-hf", str(tmp_path)], capsys)


def test_checkpoint_errors_say_what_is_wrong_and_how_to_reshard(tmp_path):
    from megatron_slapo.errors import CheckpointError
    from megatron_slapo.parallel.state import Layout
    from megatron_slapo.training.checkpointing import LATEST, checkpoint_file

    tp2 = Layout(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_group=None)
    (tmp_path / LATEST).write_text("20")
    with pytest.raises(CheckpointError, match="names iteration 20, but .*iter_0000020 does not exist") as e:
        checkpoint_file(str(tmp_path), tp2)
    assert "another tensor" not in str(e.value)  # it was not written with another layout: it is not there
    (tmp_path / "iter_0000020" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="mp_rank_00/model_optim_rng.pt is missing: .* is incomplete"):
        checkpoint_file(str(tmp_path), tp2)
    pp2 = Layout(tp_rank=0, tp_size=1, pp_rank=1, pp_size=2, dp_rank=0, dp_group=None)
    (tmp_path / "iter_0000020" / "mp_rank_01").mkdir()
    with pytest.raises(CheckpointError, match=r"holds mp_rank_00, mp_rank_01: it was written with another "
                       r"tensor/pipeline-parallel size .* To reshard it: .*to-hf .* from-hf"):  # fmt: skip
        checkpoint_file(str(tmp_path), pp2)


def test_convert_checkpoint_from_a_missing_hf_directory(tmp_path, capsys):
    from tools import convert_checkpoint

    with pytest.raises(SystemExit) as exit_:
        convert_checkpoint.main(["from-hf", "--load-hf", str(tmp_path / "nope"), "--save", str(tmp_path / "ck"),
                                 "--schedule", "gpt_tp"])  # fmt: skip
    assert str(exit_.value) == (f"convert_checkpoint.py: error: --load-hf {tmp_path / 'nope'} is not a directory: "
                                "give a directory written by save_pretrained or to-hf")  # fmt: skip


def test_albert_recompute_of_some_depths_is_refused(tmp_path, capsys):
    """ALBERT runs one layer at every depth: there is no module for "the first N layers"."""
    argv = [*SIZES, *TRAIN, "--model-type", "albert", "--recompute-granularity", "full", "--recompute-method", "block",
            "--data-cache-path", str(tmp_path)]  # fmt: skip
    assert one_error_line("bert", argv, capsys) == (
        "AlbertForPreTraining runs 1 shared layer(s) at all 2 depths: --recompute-method block / --checkpoint-ratio "
        "needs a module per depth (recompute with --recompute-method uniform or --recompute-granularity selective)"
    )
