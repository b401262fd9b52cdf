"""Train a BPE (GPT-2 style) or WordPiece (BERT style) tokenizer on local text.

Outputs the files Megatron's tokenizer types read: ``vocab.json`` + ``merges.txt`` for
``GPT2BPETokenizer``, ``vocab.txt`` for ``BertWordPieceLowerCase``/``Case``. Uses HF's
``tokenizers`` library (a transformers dependency).
"""

from __future__ import annotations

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
