"""pretrain_t5.py before any compute: the sentinel tokens (Megatron's --vocab-extra-ids) and the
refusals of bad input, one line each."""

import pytest
import transformers

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.data import embedded
from megatron_slapo.data.tokenizers import build_tokenizer
from megatron_slapo.errors import ConfigError
from megatron_slapo.training.model import pipeline_cuts
from tests.test_bad_input import one_error_line
from tools import convert_checkpoint

SIZES = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32"]
TRAIN = ["--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The embedded BERT corpus, whose sentences and WordPiece vocabulary T5 trains on."""
    cache = tmp_path_factory.mktemp("cache")
    return embedded.prepare("bert", str(cache)), str(cache)


def test_extra_ids_append_bos_eos_and_sentinels(data):
    data, _ = data
    plain = build_tokenizer(data.tokenizer_type, data.vocab_file)
    t5 = build_tokenizer(data.tokenizer_type, data.vocab_file, vocab_extra_ids=3)
    words = plain.vocab_size
    assert t5.vocab_size == words + 5 and (t5.bos, t5.eos) == (words, words + 1)
    assert t5.additional_special_tokens_ids == [words + 2, words + 3, words + 4]
    assert t5.tokenize("see <extra_id_1> here")[1] == words + 3  # a sentinel stays one token
    assert t5.inv_vocab[words + 4] == "<extra_id_2>" and t5.pad == plain.pad == 0
    assert t5.unique_identifiers != plain.unique_identifiers  # the dataset cache tells them apart


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decoder-seq-length", "8"], "--decoder-seq-length 8 cannot hold the masked spans of --seq-length 32 at "
         "--mask-prob 0.15: it needs 11"),
        # Megatron's other name for the encoder's length (after SIZES' --seq-length 32, it is the one that counts)
        (["--encoder-seq-length", "64", "--decoder-seq-length", "16"], "--decoder-seq-length 16 cannot hold the masked "
         "spans of --seq-length 64 at --mask-prob 0.15: it needs 21"),
        (["--decoder-seq-length", "16", "--vocab-extra-ids", "0"], "--vocab-extra-ids must be >= 1: T5 marks each "
         "masked span with a sentinel"),
        (["--decoder-seq-length", "16", "--schedule", "bert_tp"], "--schedule bert_tp is for bert, roberta and albert "
         "models, not t5; schedules that fit t5: default, t5_tp"),
        ([], "--decoder-seq-length is required"),
        (["--decoder-seq-length", "16", "--num-query-groups", "1"], "--num-query-groups: T5's attention has as many "
         "key/value heads as heads"),
        (["--decoder-seq-length", "16", "--num-experts", "4"], "--num-experts shapes the experts of an MoE "
         "--model-type built from the size flags (mixtral, qwen3_moe, ...), not of this model"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(argv, message, capsys, data):
    data, cache = data
    flags = ["--data-path", data.prefix, "--tokenizer-type", data.tokenizer_type, "--vocab-file", data.vocab_file,
             "--data-cache-path", cache]  # fmt: skip
    assert one_error_line("t5", [*flags, *SIZES, *TRAIN, *argv], capsys) == message


def test_two_stages_need_stacks_of_equal_depth():
    config = transformers.T5Config(num_layers=2, num_decoder_layers=3)
    with pytest.raises(ConfigError, match="needs stacks of equal depth, not 2 encoder and 3 decoder layers"):
        pipeline_cuts(config, [], 2)
    assert pipeline_cuts(transformers.T5Config(num_layers=2), [], 2) == ["decoder"]
    assert pipeline_cuts(config, [], 1) == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sequence-parallel"], "--sequence-parallel: not supported for T5 yet"),
        (["--pipeline-model-parallel-size", "4"], "T5 is cut between its encoder and its decoder, where one "
         "activation crosses: --pipeline-model-parallel-size 2 at most, without virtual stages"),
    ],
)  # fmt: skip
def test_what_t5_does_not_do_yet_is_refused(flags, message):
    args = parse_args("t5", [*SIZES, *TRAIN, "--decoder-seq-length", "16", "--tensor-model-parallel-size", "2",
                             *flags])  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        validate_args(args, world_size=8)
    assert str(refused.value) == message


def test_export_saves_the_tokenizer_with_its_sentinels(data, tmp_path):
    """to-hf writes the run's tokenizer as it trained: [BOS], [EOS] and the sentinels included."""
    data, _ = data
    saved = {"tokenizer_type": data.tokenizer_type, "vocab_file": data.vocab_file, "vocab_extra_ids": 3}
    assert convert_checkpoint._save_tokenizer(saved, str(tmp_path)) == " and its tokenizer"
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    trained = build_tokenizer(data.tokenizer_type, data.vocab_file, vocab_extra_ids=3)
    assert len(exported) == trained.vocab_size
    assert exported.convert_tokens_to_ids("<extra_id_2>") == trained.additional_special_tokens_ids[2]
