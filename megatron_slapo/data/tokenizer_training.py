"""Train a BPE (GPT-2 style) or WordPiece (BERT style) tokenizer on local text.

Outputs the files Megatron's tokenizer types read: ``vocab.json`` + ``merges.txt`` for
``GPT2BPETokenizer``, ``vocab.txt`` for ``BertWordPieceLowerCase``/``Case``. Uses HF's
``tokenizers`` library (a transformers dependency).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

EOD = "<|endoftext|>"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str, min_frequency: int = 2) -> dict[str, str]:
    """Byte-level BPE with GPT-2's ``<|endoftext|>``; returns ``{"vocab_file", "merge_file"}``."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD])
    os.makedirs(out_dir, exist_ok=True)
    vocab, merges = tok.save_model(out_dir)
    return {"vocab_file": vocab, "merge_file": merges}


def train_wordpiece(texts: Iterable[str], vocab_size: int, out_dir: str, lowercase: bool = True) -> dict[str, str]:
    """BERT WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK]; returns ``{"vocab_file"}``."""
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=lowercase)
    tok.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=BERT_SPECIALS)
    os.makedirs(out_dir, exist_ok=True)
    (vocab,) = tok.save_model(out_dir)
    return {"vocab_file": vocab}


def saved_vocab_size(files: dict[str, str]) -> int:
    """Number of tokens in the vocabulary ``train_bpe``/``train_wordpiece`` wrote (``files`` is what they
    returned): the size Megatron's tokenizer will have. It can be smaller than the ``vocab_size`` asked
    for, since training stops once the corpus has no more pairs to merge (or words to split)."""
    path = files["vocab_file"]
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):  # BPE: {token: id}
            return len(json.load(f))
        return sum(1 for _ in f)  # WordPiece: one token a line
