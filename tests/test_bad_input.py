"""Bad input to the entry points: one ``prog: error: ...`` line and exit status 2, before any compute.

Each case runs ``pretrain`` in this process: an exception other than the one-line exit (a
KeyError, a ZeroDivisionError, megatron-core's assertions) fails the test with its traceback.
"""

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import transformers

from megatron_slapo.training.loop import pretrain
from schedules import auto

GPT = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0"]


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
    from megatron_slapo.arguments.parser import parse_args

    args = parse_args("gpt", ["--lr", "1e-5", "--lr-warmup-iters", "3"])
    assert args.min_lr == pytest.approx(1e-6) and args.lr_warmup_fraction is None  # follow what was given
    assert one_error_line("gpt", ["--lr=-1e-3"], capsys) == "--lr -0.001 must be >= 0"  # not "--min-lr ... --lr"
    message = one_error_line("gpt", ["--max-position-embeddings", "64"], capsys)
    assert message == "--seq-length 128 (the embedded run's default) exceeds --max-position-embeddings 64"


def test_embedded_run_with_a_pretrained_model_keeps_its_shape(tmp_path):
    from megatron_slapo.arguments.parser import parse_args

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
    from megatron_slapo.checkpoints.checkpointing import LATEST, checkpoint_file
    from megatron_slapo.errors import CheckpointError
    from megatron_slapo.parallel.state import Layout

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
                       r"tensor/pipeline-parallel size .* To reshard it: .*--auto-detect-ckpt-format .*to-torch-dist"):  # fmt: skip
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


# The bad-input table: what a new user tried, each case one line naming the flag or file, exit
# status 2, no traceback, and no file that existed before the run changed. A case is
# (prog, argv built from the fixtures it writes into tmp_path, what the line must say).


def _hashes(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _gpt2(tmp_path: Path, weights: bool = False, **fields) -> str:
    """A tiny GPT-2 directory, as save_pretrained writes it (config only, or with weights), with
    ``fields`` then written into its config.json."""
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=100,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    directory = tmp_path / ("gpt2-weights" if weights else "gpt2")
    (transformers.GPT2LMHeadModel(config) if weights else config).save_pretrained(directory)
    if fields:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(directory)


def _llama(tmp_path: Path, **fields) -> str:
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=100,
                                      intermediate_size=32, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    path = tmp_path / "llama" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return str(tmp_path / "llama")


def _truncated_weights(tmp_path: Path) -> str:
    directory = Path(_gpt2(tmp_path, weights=True))
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(directory)


def _malformed_config(tmp_path: Path) -> str:
    directory = Path(_gpt2(tmp_path))
    (directory / "config.json").write_text('{"model_type": "gpt2", "n_head": 2,')
    return str(directory)


def _dataset(tmp_path: Path, *documents: str) -> str:
    """An indexed dataset of ``documents`` (space-separated token ids), by the project's writer."""
    from megatron_slapo.data.preprocess import encode_corpus
    from megatron_slapo.data.tokenizers import NullTokenizer

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    prefixes = encode_corpus(str(tmp_path / "docs.jsonl"), str(tmp_path / "docs"), lambda: NullTokenizer(100), 101,
                             progress=False)  # fmt: skip
    return prefixes["text"]


def _data(tmp_path: Path, *documents: str) -> list[str]:
    return ["--data-path", _dataset(tmp_path, *documents), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip


def _corrupt_vocab(tmp_path: Path) -> list[str]:
    (tmp_path / "vocab.json").write_text('{"hello": 0,')
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\n")
    return ["--data-path", _dataset(tmp_path, "1 2 3"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]  # fmt: skip


def _parent_is_a_file(tmp_path: Path) -> str:
    (tmp_path / "notes.txt").write_text("not a directory")
    return str(tmp_path / "notes.txt" / "plan.json")


def _converted(tmp_path: Path) -> str:
    """``_gpt2``'s model (1 layer of 16, 2 heads) as the checkpoint convert_checkpoint.py from-hf writes."""
    from megatron_slapo import parallel
    from tools import convert_checkpoint

    try:
        convert_checkpoint.main(["from-hf", "--load-hf", _gpt2(tmp_path, weights=True), "--save", str(tmp_path / "ck")])
    finally:
        parallel.destroy()
    return str(tmp_path / "ck")


def _trained(tmp_path: Path) -> str:
    """A checkpoint of the SIZES model (2 layers of 32, 2 heads), as a training run saves it."""
    from megatron_slapo import parallel

    try:
        pretrain("gpt", [*GPT, *SIZES, *TRAIN, "--save", str(tmp_path / "ck")])
    finally:
        parallel.destroy()
    return str(tmp_path / "ck")


LLAMA = ["--model-type", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16"]  # fmt: skip
BAD_INPUT: dict[str, tuple[str, Callable[[Path], list[str]], str]] = {
    # every missing required flag in one line, then every contradiction
    "required flags": ("pretrain_gpt.py", lambda t: ["--mock-data"],
                       "--micro-batch-size, --train-iters (or --train-samples), --lr and --tokenizer-type are required; "
                       "--num-layers, --hidden-size, --num-attention-heads and --seq-length are required (or give "
                       "--hf-config / --load-hf)"),
    "required flags and conflicts": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, "--bf16", "--fp16", "--finetune"],
                                     "--micro-batch-size, --train-iters (or --train-samples) and --lr are required; "
                                     "--bf16 and --fp16 are mutually exclusive; --finetune needs --load DIR"),
    "hidden size the heads do not split": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, *_replace(SIZES, "--hidden-size",
                                           "65")], "--hidden-size 65 is not divisible by --num-attention-heads 2"),
    "query groups that do not divide the heads": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, *LLAMA,
                                                  "--num-query-groups", "3"],
                                                  "--num-query-groups 3 does not divide --num-attention-heads 4"),
    "negative seed": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--seed", "-1"],
                      "--seed -1 must lie between 0 and 4294967295"),
    "split not numbers": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--split", "abc"],
                          "--split abc must be up to three weights"),
    "split all zero": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--split", "0,0,0"],
                       "--split 0,0,0 gives every split weight 0"),
    "lr inf": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--lr", "inf"], "--lr inf must be a finite number"),
    "lr nan": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--lr", "nan"], "--lr nan must be a finite number"),
    "init std nan": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--init-method-std", "nan"],
                     "--init-method-std nan must be a finite number"),
    "documents all empty": ("pretrain_gpt.py", lambda t: [*_data(t, "", ""), *SIZES, *TRAIN],
                            "its 2 documents are all empty (no tokens)"),
    "train split of empty documents": ("pretrain_gpt.py", lambda t: [*_data(t, "", "", "1 2 3", "4 5 6"), *SIZES,
                                       *TRAIN, "--split", "50,50,0"],
                                       "leaves the train split of {t}/docs_text_document (4 documents) 2 documents "
                                       "with no tokens"),
    "hf config with 0 heads": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--hf-config", _gpt2(t, n_head=0)],
                               "--hf-config {t}/gpt2: config.json has n_head 0: a model needs at least 1"),
    "hf config with 3 of 4 key/value heads": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--hf-config",
                                              _llama(t, num_key_value_heads=3)],
                                              "config.json's num_key_value_heads 3 does not divide its "
                                              "num_attention_heads 4"),
    "hf config not JSON": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--hf-config", _malformed_config(t)],
                           "--hf-config {t}/gpt2: {t}/gpt2/config.json is not valid JSON"),
    "load-hf without weights": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--load-hf", _gpt2(t)],
                                "--load-hf {t}/gpt2 has a config.json but no weights"),
    "load-hf truncated safetensors": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--load-hf", _truncated_weights(t)],
                                      "{t}/gpt2-weights/model.safetensors cannot be read"),
    "load-hf of another model type": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--load-hf", _gpt2(t),
                                      "--model-type", "llama"],
                                      "--model-type llama contradicts --load-hf {t}/gpt2, which holds a gpt2 model"),
    "corrupt vocab JSON": ("pretrain_gpt.py", lambda t: [*_corrupt_vocab(t), *SIZES, *TRAIN],
                           "--vocab-file {t}/vocab.json is not valid JSON"),
    "MoE family without a default top-k": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--model-type", "dots1",
                                           "--num-experts", "4"],
                                           "--model-type dots1 has no default number of experts per token: give "
                                           "--moe-router-topk"),
    # a size flag the family has no place for, which the run would ignore
    "query groups for GPT-2": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--num-query-groups", "2"],
                               "--num-query-groups 2: gpt2 has no grouped-query attention"),
    "query groups for BERT": ("pretrain_bert.py", lambda t: [*GPT, *SIZES, *TRAIN, "--num-query-groups", "1"],
                              "--num-query-groups 1: bert has no grouped-query attention"),
    "query groups for GPT-NeoX": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--model-type", "gpt_neox",
                                  "--num-query-groups", "1"], "--num-query-groups 1: gpt_neox has no grouped-query "
                                  "attention"),
    "FFN width for GPT-BigCode": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--model-type", "gpt_bigcode",
                                  "--ffn-hidden-size", "64"], "--ffn-hidden-size 64: gpt_bigcode takes no FFN width "
                                  "from the flags"),
    "hidden dropout for Llama": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, *LLAMA, "--hidden-dropout", "0.2"],
                                 "--hidden-dropout 0.2: llama has no dropout on its hidden states"),
    "positions for T5": ("pretrain_t5.py", lambda t: [*GPT, *SIZES, *TRAIN, "--decoder-seq-length", "8",
                         "--max-position-embeddings", "32"], "--max-position-embeddings 32: t5 has no position "
                         "embeddings"),
    "size flag against an HF config": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--hf-config", _gpt2(t),
                                       "--num-layers", "2"], "--num-layers 2 contradicts --hf-config {t}/gpt2, whose "
                                       "model has 1: drop it (the config shapes the model)"),
    # a checkpoint of another model: the trainer and explain refuse it alike, before any compute
    "load of another depth": ("pretrain_gpt.py", lambda t: ["--load", _trained(t), *GPT, *TRAIN,
                              *_replace(SIZES, "--num-layers", "4")],
                              "{t}/ck/iter_0000002 holds a model of 2 layers, this run builds 4: give --num-layers 2, "
                              "or another --load"),
    "explain: load of another depth and heads": ("explain.py", lambda t: ["--load", _trained(t), *GPT, *TRAIN,
                                                 *_replace(_replace(SIZES, "--num-layers", "4"),
                                                           "--num-attention-heads", "4")],
                                                 "{t}/ck/iter_0000002 holds a model of 2 layers, this run builds 4: "
                                                 "give --num-layers 2; holds a model of 2 attention heads, this run "
                                                 "builds 4: give --num-attention-heads 2, or another --load"),
    "explain: load of another width": ("explain.py", lambda t: ["--load", _trained(t), *GPT, *TRAIN,
                                       *_replace(SIZES, "--hidden-size", "64")],
                                       "{t}/ck/iter_0000002 holds model.transformer.wte.weight of shape (128, 32), "
                                       "this model's is (128, 64): the checkpoint is of another model"),
    "explain: load of a converted model with another depth": ("explain.py", lambda t: ["--load", _converted(t), *GPT,
                                                              *TRAIN, "--use-checkpoint-args", "--num-layers", "2"],
                                                              "--num-layers 2 contradicts --load {t}/ck, whose model "
                                                              "has 1: drop it (the config shapes the model)"),
    "exit signal without its handler": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--exit-signal", "SIGINT"],
                                        "--exit-signal SIGINT is what --exit-signal-handler listens for: add "
                                        "--exit-signal-handler (a Ctrl-C without it stops the run at once)"),
    "checkpoint args without a checkpoint": ("pretrain_gpt.py", lambda t: [*GPT, *TRAIN, "--use-checkpoint-args",
                                             "--load", str(t / "empty")],
                                             "--use-checkpoint-args: --load {t}/empty holds no checkpoint to take the "
                                             "model's flags from"),
    "checkpoint args without --load": ("pretrain_gpt.py", lambda t: [*GPT, *SIZES, *TRAIN, "--use-checkpoint-args"],
                                       "--use-checkpoint-args needs --load DIR"),
    "checkpoint's positions exceeded": ("pretrain_gpt.py", lambda t: ["--load", _trained(t), *GPT, *TRAIN,
                                        "--seq-length", "32"], "--seq-length 32 exceeds --max-position-embeddings 16 "
                                        "(the checkpoint's, in --load)"),
    "explain: unknown flag": ("explain.py", lambda t: ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "explain: huge world": ("explain.py", lambda t: ["--world-size", "1000000"],
                            "--world-size 1000000 must lie between 1 and 65536"),
    "explain: --json under a file": ("explain.py", lambda t: ["--json", _parent_is_a_file(t), *GPT, *SIZES, *TRAIN],
                                     "--json {t}/notes.txt/plan.json: {t}/notes.txt is a file"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_before_any_compute(case, tmp_path, capsys):
    prog, argv_of, expected = BAD_INPUT[case]
    argv = argv_of(tmp_path)
    before = _hashes(tmp_path)
    capsys.readouterr()  # what writing the fixtures printed
    with pytest.raises(SystemExit) as exit_:
        if prog == "explain.py":
            from tools import explain

            explain.main(argv)
        else:
            pretrain(prog.removeprefix("pretrain_").removesuffix(".py"), argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{prog}: error: ") and "Traceback" not in out
    assert expected.format(t=tmp_path) in lines[0]
    after = _hashes(tmp_path)
    assert {path: after.get(path) for path in before} == before  # nothing that was there changed


def test_sharded_weights_are_checked_shard_by_shard(tmp_path):
    from megatron_slapo.checkpoints.pretrained import check_weights
    from megatron_slapo.errors import ConfigError

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=100)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, max_shard_size="10KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    check_weights("--load-hf DIR", str(tmp_path))  # whole: nothing to say
    shards[1].write_bytes(shards[1].read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"{shards[1].name} cannot be read .*: truncated or corrupt"):
        check_weights("--load-hf DIR", str(tmp_path))
    shards[0].unlink()
    with pytest.raises(ConfigError, match=f"model.safetensors.index.json names {shards[0].name}, which is missing"):
        check_weights("--load-hf DIR", str(tmp_path))
