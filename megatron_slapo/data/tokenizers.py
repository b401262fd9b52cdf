"""Megatron's tokenizer types, from local files.

``--tokenizer-type`` takes Megatron's names: ``GPT2BPETokenizer`` (``--vocab-file`` vocab.json,
``--merge-file`` merges.txt), ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (``--vocab-file``
vocab.txt), ``HuggingFaceTokenizer`` (``--tokenizer-model DIR``) and ``NullTokenizer``
(``--vocab-size``). The objects expose what megatron-core's datasets read (``tokenize``,
``vocab_size``, ``eod``, ``cls``/``sep``/``mask``/``pad``, ``inv_vocab``, ``unique_identifiers``).
``--vocab-extra-ids N`` (T5) adds, as Megatron's WordPiece tokenizer does, ``[BOS]`` and ``[EOS]``
and N sentinels ``<extra_id_0>`` ... at the end of the vocabulary (``bos``, ``eos``,
``additional_special_tokens_ids``).

Why not ``megatron.core.tokenizers``: in megatron-core 0.16 its GPT-2 and WordPiece tokenizers
instantiate ``AutoTokenizer.from_pretrained("gpt2" | "bert-large-uncased")`` and so need the HF
hub even when the vocabulary files are given; these wrappers build the same HF fast tokenizers
from the files alone.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

from megatron_slapo.errors import ConfigError

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


class Tokenizer:
    """Megatron's tokenizer interface over an HF fast tokenizer."""

    def __init__(self, hf: Any, kind: str, source: str) -> None:
        self.hf, self.kind, self.source = hf, kind, source
        self.extra_tokens: list[str] = []
        self.additional_special_tokens_ids: list[int] = []  # T5's sentinels (--vocab-extra-ids), in order
        self._index_vocab()

    def _index_vocab(self) -> None:
        self.vocab = self.hf.get_vocab()
        # Ordered by id: HF's get_vocab() order varies between processes, and megatron-core's BERT
        # dataset draws random replacement tokens by position in this dict.
        self.inv_vocab = {i: t for t, i in sorted(self.vocab.items(), key=lambda item: item[1])}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What megatron-core's dataset cache keys on."""
        return OrderedDict(cls=self.kind, source=self.source, vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def _special(self, name: str) -> int:
        """The id of a special token; AttributeError when the vocabulary has none (what megatron-core expects)."""
        token_id = getattr(self.hf, f"{name}_token_id", None)
        if token_id is None:
            raise AttributeError(f"{self.kind} tokenizer from {self.source} has no {name} token")
        return token_id

    @property
    def eod(self) -> int:
        try:
            return self._special("eos")
        except AttributeError:
            return self._special("sep")

    bos = property(lambda self: self._special("bos"))
    eos = property(lambda self: self._special("eos"))
    cls = property(lambda self: self._special("cls"))
    sep = property(lambda self: self._special("sep"))
    mask = property(lambda self: self._special("mask"))
    pad = property(lambda self: self._special("pad"))

    def add_extra_ids(self, count: int) -> None:
        """Megatron's ``--vocab-extra-ids``: [BOS], [EOS] (where missing) and ``count`` sentinels."""
        self.extra_tokens = [f"<extra_id_{i}>" for i in range(count)]
        special = {"additional_special_tokens": self.extra_tokens}
        for name, token in (("bos_token", "[BOS]"), ("eos_token", "[EOS]")):
            if getattr(self.hf, f"{name}_id", None) is None:
                special[name] = token
        self.hf.add_special_tokens(special)
        self._index_vocab()
        self.additional_special_tokens_ids = [self.vocab[token] for token in self.extra_tokens]  # read per sample
        self.source = f"{self.source}+{count} extra ids"  # what the dataset cache keys on


class NullTokenizer:
    """Text is already space-separated ids; ``eod`` is ``vocab_size`` (Megatron's NullTokenizer)."""

    kind = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        self._size = vocab_size
        self.unique_identifiers = OrderedDict(cls=self.kind, vocab_size=vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._size + 1

    @property
    def eod(self) -> int:
        return self._size

    inv_vocab: dict[int, str] = {}

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def _require(path: str | None, flag: str, kind: str) -> str:
    if not path:
        raise ConfigError(f"--tokenizer-type {kind} needs {flag}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path} does not exist")
    return path


def _read_bpe(vocab_file: str, merge_file: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """GPT-2's vocab.json (token -> id) and merges.txt (a pair per line), checked to be so."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--vocab-file {vocab_file} is not valid JSON ({e}): give GPT-2's vocab.json") from e
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ConfigError(f"--vocab-file {vocab_file} does not map tokens to ids: give GPT-2's vocab.json")
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"--merge-file {merge_file} is not UTF-8 text ({e}): give GPT-2's merges.txt") from e
    merges = []
    for number, line in enumerate(lines, 1):
        if line.strip() and not line.startswith("#version"):
            pair = tuple(line.split())
            if len(pair) != 2:
                raise ConfigError(f"--merge-file {merge_file} line {number} is not a pair of tokens: give GPT-2's "
                                  "merges.txt")  # fmt: skip
            merges.append(pair)
    return vocab, merges


def _read_wordpiece(vocab_file: str) -> dict[str, int]:
    """BERT's vocab.txt: a token per line, its id the line's number (from 0)."""
    try:
        with open(vocab_file, encoding="utf-8") as f:
            return {token.rstrip("\n"): i for i, token in enumerate(f)}
    except UnicodeDecodeError as e:
        raise ConfigError(f"--vocab-file {vocab_file} is not UTF-8 text ({e}): give BERT's vocab.txt") from e


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_extra_ids: int = 0,
) -> Tokenizer | NullTokenizer:
    """The tokenizer Megatron's ``--tokenizer-type`` names, built from local files (with
    ``vocab_extra_ids`` T5's special tokens added)."""
    tokenizer = _build(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size)
    if vocab_extra_ids:
        if not isinstance(tokenizer, Tokenizer):
            raise ConfigError(f"--vocab-extra-ids needs a vocabulary to extend, not --tokenizer-type {tokenizer_type}")
        tokenizer.add_extra_ids(vocab_extra_ids)
    return tokenizer


def _build(
    tokenizer_type: str,
    vocab_file: str | None,
    merge_file: str | None,
    tokenizer_model: str | None,
    vocab_size: int | None,
) -> Tokenizer | NullTokenizer:
    import transformers

    if tokenizer_type == "GPT2BPETokenizer":
        vocab = _require(vocab_file, "--vocab-file", tokenizer_type)
        merges = _require(merge_file, "--merge-file", tokenizer_type)
        vocab_map, merge_list = _read_bpe(vocab, merges)
        return Tokenizer(transformers.GPT2TokenizerFast(vocab=vocab_map, merges=merge_list), tokenizer_type, vocab)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _require(vocab_file, "--vocab-file", tokenizer_type)
        lower = tokenizer_type.endswith("LowerCase")
        hf = transformers.BertTokenizerFast(vocab=_read_wordpiece(vocab), do_lower_case=lower)
        return Tokenizer(hf, tokenizer_type, vocab)
    if tokenizer_type == "HuggingFaceTokenizer":
        model = _require(tokenizer_model, "--tokenizer-model", tokenizer_type)
        try:
            hf = transformers.AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:  # transformers' "not a tokenizer I can read", whatever the file
            raise ConfigError(
                f"--tokenizer-model {model} is not a tokenizer transformers can read ("
                f"{' '.join(str(e).split())}): give a directory written by save_pretrained"
            ) from e
        return Tokenizer(hf, tokenizer_type, model)
    if tokenizer_type == "NullTokenizer":
        if not vocab_size:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ConfigError(f"unknown --tokenizer-type {tokenizer_type!r}; expected one of {', '.join(TOKENIZER_TYPES)}")
