"""The corpus that ships with Python: a default dataset that needs no download.

CPython installs ``pydoc_data.topics``, the text of the language reference's help topics (about
465k characters of English with code). It is split at paragraph boundaries into documents,
a tokenizer is trained on it, and it is preprocessed into Megatron's indexed format exactly as
``tools/preprocess_data.py`` would, so a default run exercises the real data pipeline. The result
is cached (built once, atomically, by global rank 0).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial

from megatron_slapo.data.preprocess import encode_corpus
from megatron_slapo.data.tokenizer_training import train_bpe, train_wordpiece
from megatron_slapo.data.tokenizers import build_tokenizer

VERSION = "v1"
DOC_CHARS = 2000  # target document size


@dataclass(frozen=True)
class EmbeddedData:
    prefix: str
    tokenizer_type: str
    vocab_file: str
    merge_file: str | None


def documents() -> list[str]:
    """The help topics, cut into ~2k-character documents at blank lines."""
    from pydoc_data.topics import topics

    docs = []
    for _, text in sorted(topics.items()):
        current = ""
        for para in text.split("\n\n"):
            current = f"{current}\n\n{para}" if current else para
            if len(current) >= DOC_CHARS:
                docs.append(current.strip())
                current = ""
        if current.strip():
            docs.append(current.strip())
    return docs


def _layout(root: str, kind: str) -> EmbeddedData:
    if kind == "gpt":
        return EmbeddedData(
            os.path.join(root, "pydoc_text_document"),
            "GPT2BPETokenizer",
            os.path.join(root, "vocab.json"),
            os.path.join(root, "merges.txt"),
        )
    return EmbeddedData(
        os.path.join(root, "pydoc_text_sentence"), "BertWordPieceLowerCase", os.path.join(root, "vocab.txt"), None
    )


def _build(root: str, kind: str, vocab_size: int) -> None:
    docs = documents()
    if kind == "gpt":
        train_bpe(docs, vocab_size, root)
    else:
        train_wordpiece(docs, vocab_size, root)
    data = _layout(root, kind)
    corpus = os.path.join(root, "pydoc.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    make = partial(build_tokenizer, data.tokenizer_type, data.vocab_file, data.merge_file)
    encode_corpus(
        corpus,
        os.path.join(root, "pydoc"),
        make,
        make().vocab_size,
        append_eod=kind == "gpt",
        sentences=kind == "bert",
        progress=False,
    )


def prepare(kind: str, cache_dir: str, vocab_size: int = 4096) -> EmbeddedData:
    """Build (if needed) and locate the embedded dataset for ``kind`` ("gpt" or "bert")."""
    root = os.path.join(cache_dir, f"embedded-{kind}-{VERSION}")
    if not os.path.isdir(root):
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".embedded-{kind}-", dir=cache_dir)
        try:
            _build(tmp, kind, vocab_size)
            os.replace(tmp, root)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(root):  # another process may have won the race
                raise
    return _layout(root, kind)
