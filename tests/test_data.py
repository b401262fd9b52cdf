"""Data pipeline in one process: tokenizers, preprocessing to .bin/.idx, validation, the sampler."""

import json
import os
import struct

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_slapo.data import embedded, indexed
from megatron_slapo.data.datasets import SplitSizes, check_prefix, check_splits, parse_data_path
from megatron_slapo.data.indexed import read_index
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


@pytest.fixture(scope="module")
def gpt(corpus, bpe):
    """The corpus preprocessed for GPT-2, its text and title keys (``{prefix}_text_document``); a
    fixture, so that every test reading it runs alone or in any order."""
    root, path = corpus
    vocab, merges = bpe
    prefix = str(root / "gpt")
    preprocess_data.main([
        "--input", path, "--json-keys", "text", "title", "--output-prefix", prefix, "--tokenizer-type",
        "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "2",
        "--no-progress",
    ])  # fmt: skip
    return prefix


def test_gpt2_bpe_preprocess_roundtrip(gpt, bpe):
    vocab, merges = bpe
    prefix = gpt
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


def test_cased_wordpiece_keeps_capitals(corpus):
    """BertWordPieceCase on a vocabulary trained ``--cased``: "The" and "the" are different tokens,
    and the preprocessed sentences come back with their capitals (lower-cased, they would not)."""
    root, path = corpus
    train_tokenizer.main(["--input", path, "--type", "wordpiece", "--vocab-size", "300", "--cased", "--output-dir",
                          str(root / "wp-cased")])  # fmt: skip
    vocab = str(root / "wp-cased" / "vocab.txt")
    tok = build_tokenizer("BertWordPieceCase", vocab)
    assert tok.tokenize("The") != tok.tokenize("the") and tok.detokenize(tok.tokenize("The fox")) == "The fox"
    prefix = str(root / "bert-cased")
    preprocess_data.main(["--input", path, "--output-prefix", prefix, "--tokenizer-type", "BertWordPieceCase",
                          "--vocab-file", vocab, "--split-sentences", "--no-progress"])  # fmt: skip
    data = IndexedDataset(f"{prefix}_text_sentence")
    assert tok.detokenize(data[0].tolist()) == "The quick brown fox jumps over the lazy dog."


@pytest.mark.parametrize(
    "kind, tokenizer_type, files",
    [
        ("bpe", "GPT2BPETokenizer", ("vocab.json", "merges.txt")),
        ("wordpiece", "BertWordPieceLowerCase", ("vocab.txt",)),
    ],
)
def test_train_tokenizer_says_when_the_corpus_gives_fewer_tokens(corpus, tmp_path, capsys, kind, tokenizer_type, files):
    """A --vocab-size the small corpus cannot fill: one note says how many tokens it gave, and the
    summary states the real size (the tokenizer Megatron builds from the files), not the one asked
    for; a size the corpus does fill gets no note."""
    _, path = corpus
    train_tokenizer.main(["--input", path, "--type", kind, "--vocab-size", "32768", "--output-dir",
                          str(tmp_path / "big")])  # fmt: skip
    real = build_tokenizer(tokenizer_type, *(str(tmp_path / "big" / f) for f in files)).vocab_size
    assert real < 32768
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("note:")]
    assert note == [
        f"note: the corpus gives {real:,} tokens, fewer than --vocab-size 32768: the tokenizer has {real:,}"
    ]
    assert f"trained a {real:,}-token vocabulary; use: --tokenizer-type {tokenizer_type}" in out
    train_tokenizer.main(["--input", path, "--type", kind, "--vocab-size", str(real - 10), "--output-dir",
                          str(tmp_path / "small")])  # fmt: skip
    out = capsys.readouterr().out
    assert "note:" not in out and f"trained a {real - 10:,}-token vocabulary" in out


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


def _copy_dataset(src: str, dst: str, idx: bytes | None = None) -> str:
    for ext in (".bin", ".idx"):
        with open(src + ext, "rb") as f, open(dst + ext, "wb") as g:
            g.write(idx if ext == ".idx" and idx is not None else f.read())
    return dst


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no "Exception ignored in __del__"
def test_missing_and_corrupt_data_are_clear_errors(gpt, tmp_path):
    with pytest.raises(DataError, match=r"data prefix '.*/nothing': .*nothing.idx does not exist"):
        check_prefix(str(tmp_path / "nothing"))
    good = f"{gpt}_text_document"
    index = open(good + ".idx", "rb").read()
    prefix = str(tmp_path / "bad")
    header = 9 + 8 + 1 + 8 + 8
    n_seq = struct.unpack("<Q", index[18:26])[0]
    pointers = header + 4 * n_seq
    cases = {
        "is not a Megatron index": b"NOTMEGA" + index[7:],
        "corrupt or truncated: its header promises": index[:40],
        "dtype code 6 is not an integer token type": index[:17] + bytes([6]) + index[18:],  # float64
        "document boundaries": index[:-8] + struct.pack("<q", n_seq + 5),
        "sequence pointers and lengths disagree": index[:pointers + 8] + struct.pack("<q", 3) + index[pointers + 16 :],
    }  # fmt: skip
    for message, idx in cases.items():
        with pytest.raises(DataError, match=message):
            check_prefix(_copy_dataset(good, prefix, idx))
    _copy_dataset(good, prefix)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="bad.bin is shorter"):
        check_prefix(prefix)


def test_token_ids_beyond_the_vocabulary_are_refused(gpt, monkeypatch):
    """Data made with a larger tokenizer trains silently under TP (the ids are another rank's rows)
    and crashes at TP1: refused up front, by a full scan of a small .bin or a sample of a large one."""
    prefix = f"{gpt}_text_document"
    tokens = numpy.memmap(prefix + ".bin", mode="r", dtype=read_index(prefix).dtype)
    largest = int(tokens.max())
    assert check_prefix(prefix, largest + 1, "tokenizer (GPT2BPETokenizer)") == len(DOCS)
    with pytest.raises(DataError, match=rf"gpt_text_document.bin holds token ids from \d+ to {largest}, but the "
                       rf"tokenizer \(GPT2BPETokenizer\) has {largest} tokens"):  # fmt: skip
        check_prefix(prefix, largest, "tokenizer (GPT2BPETokenizer)")
    monkeypatch.setattr(indexed, "FULL_SCAN_BYTES", 0)  # a "large" file: sampled, and said so
    monkeypatch.setattr(indexed, "_WINDOW_TOKENS", 8)
    with pytest.raises(DataError, match=r"\(in a sample of it\)"):
        check_prefix(prefix, 10, "tokenizer (GPT2BPETokenizer)")


def test_preprocess_creates_the_output_directory(corpus, bpe, tmp_path):
    root, path = corpus
    vocab, merges = bpe
    prefix = str(tmp_path / "data" / "nested" / "gpt")  # the README's `--output-prefix data/my-gpt2`, no data/ yet
    preprocess_data.main(["--input", path, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
                          "--vocab-file", vocab, "--merge-file", merges, "--no-progress"])  # fmt: skip
    assert check_prefix(f"{prefix}_text_document") == len(DOCS)


def test_split_checks(gpt):
    prefix = f"{gpt}_text_document"  # 60 documents
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
