"""Data pipeline in one process: tokenizers, preprocessing to .bin/.idx, validation, the sampler."""

import json
import os

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_slapo.data import embedded
from megatron_slapo.data.datasets import SplitSizes, check_prefix, check_splits, parse_data_path
from megatron_slapo.data.preprocess import split_sentences
from megatron_slapo.data.samplers import PretrainingSampler
from megatron_slapo.data.tokenizers import build_tokenizer
from megatron_slapo.errors import DataError
from tools import preprocess_data, train_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog. It was not amused! Why would it be?",
    "Tensor parallelism splits each layer across devices. Pipeline parallelism splits the layers.",
    "Megatron-LM trains large transformers. HuggingFace provides the models.",
] * 20


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    path = root / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d, "title": d[:10]}) + "\n" for d in DOCS))
    return root, str(path)


@pytest.fixture(scope="module")
def bpe(corpus):
    root, path = corpus
    train_tokenizer.main(["--input", path, "--type", "bpe", "--vocab-size", "400", "--output-dir", str(root / "bpe")])
    return str(root / "bpe" / "vocab.json"), str(root / "bpe" / "merges.txt")


def test_gpt2_bpe_preprocess_roundtrip(corpus, bpe):
    root, path = corpus
    vocab, merges = bpe
    prefix = str(root / "gpt")
    preprocess_data.main([
        "--input", path, "--json-keys", "text", "title", "--output-prefix", prefix, "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "2",
        "--no-progress",
    ])  # fmt: skip
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    data = IndexedDataset(f"{prefix}_text_document")
    assert len(data) == len(DOCS) and data.document_indices.shape[0] == len(DOCS) + 1
    for i in (0, 1, 59):
        ids = data[i].tolist()
        assert ids[-1] == tok.eod and tok.detokenize(ids[:-1]) == DOCS[i]
    assert os.path.exists(f"{prefix}_title_document.idx")
    with open(f"{prefix}_text_document.idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"  # Megatron's header
    assert check_prefix(f"{prefix}_text_document") == len(DOCS)


def test_wordpiece_sentence_split_for_bert(corpus):
    root, path = corpus
    train_tokenizer.main(
        ["--input", path, "--type", "wordpiece", "--vocab-size", "300", "--output-dir", str(root / "wp")]
    )
    vocab = str(root / "wp" / "vocab.txt")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    assert None not in (tok.cls, tok.sep, tok.mask, tok.pad) and len({tok.cls, tok.sep, tok.mask, tok.pad}) == 4
    prefix = str(root / "bert")
    preprocess_data.main([
        "--input", path, "--output-prefix", prefix, "--tokenizer-type", "BertWordPieceLowerCase",
        "--vocab-file", vocab, "--split-sentences", "--no-progress",
    ])  # fmt: skip
    data = IndexedDataset(f"{prefix}_text_sentence")
    assert data.document_indices.shape[0] == len(DOCS) + 1
    assert len(data) == sum(len(split_sentences(d)) for d in DOCS)  # one sequence per sentence
    assert tok.detokenize(data[0].tolist()) == "the quick brown fox jumps over the lazy dog."


def test_split_sentences():
    assert split_sentences('He said "stop." Then he left! Dr. Smith? yes. 3 cats.\nNew line') == [
        'He said "stop."', "Then he left!", "Dr.", "Smith? yes.", "3 cats.", "New line",
    ]  # fmt: skip


def test_null_and_hf_tokenizers(tmp_path, bpe):
    null = build_tokenizer("NullTokenizer", vocab_size=1000)
    assert null.vocab_size == 1001 and null.eod == 1000 and null.tokenize("5 6 7") == [5, 6, 7]
    build_tokenizer("GPT2BPETokenizer", *bpe).hf.save_pretrained(tmp_path)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert hf.tokenize("the quick fox") == build_tokenizer("GPT2BPETokenizer", *bpe).tokenize("the quick fox")
    with pytest.raises(ValueError, match="needs --vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(FileNotFoundError, match="--merge-file nope.txt does not exist"):
        build_tokenizer("GPT2BPETokenizer", bpe[0], "nope.txt")


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)  # megatron-core's __del__ after a failed open
def test_missing_and_corrupt_data_are_clear_errors(corpus, bpe, tmp_path):
    with pytest.raises(DataError, match=r"data prefix '.*/nothing': .*nothing.idx does not exist"):
        check_prefix(str(tmp_path / "nothing"))
    root, _ = corpus
    prefix = str(tmp_path / "bad")
    for ext in (".bin", ".idx"):
        with open(f"{root}/gpt_text_document{ext}", "rb") as src, open(prefix + ext, "wb") as dst:
            dst.write(src.read())
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMEGA")
    with pytest.raises(DataError, match="is not a Megatron index"):
        check_prefix(prefix)
    with open(f"{root}/gpt_text_document.idx", "rb") as src, open(prefix + ".idx", "wb") as dst:
        dst.write(src.read()[:40])  # truncated
    with pytest.raises(DataError, match="corrupt"):
        check_prefix(prefix)


def test_split_checks(corpus):
    root, _ = corpus
    prefix = f"{root}/gpt_text_document"  # 60 documents
    assert check_splits([prefix], "98,2,0", SplitSizes(10, 5, 0)) == "0.98,0.02,0"
    assert check_splits([prefix], "969,30,1", SplitSizes(10, 5, 0)) == "0.969,0.03,0"  # unused empty test split
    with pytest.raises(DataError, match="leaves the valid split .* empty, but 5 valid samples are needed"):
        check_splits([prefix], "100,0,0", SplitSizes(10, 5, 0))
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])


def test_sampler_resumes_where_it_stopped():
    full = list(PretrainingSampler(32, 0, micro_batch_size=2, dp_rank=1, dp_size=2))
    resumed = list(PretrainingSampler(32, 12, micro_batch_size=2, dp_rank=1, dp_size=2))
    assert full[0] == [2, 3] and full[1] == [6, 7]
    assert resumed == full[3:]


def test_embedded_corpus_is_real_text():
    docs = embedded.documents()
    assert len(docs) > 200 and sum(len(d) for d in docs) > 400_000
    assert any("lambda" in d for d in docs)
