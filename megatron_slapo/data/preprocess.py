"""Text -> Megatron's indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``, the MMIDIDX format).

The writer is megatron-core's ``IndexedDatasetBuilder``, so the files are exactly what Megatron-LM
reads. Each JSON line is one document; with sentence splitting each sentence becomes one
sequence of the document (what the BERT dataset pairs into segments).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

# A sentence ends at . ! or ? (optionally closed by quotes/brackets) followed by whitespace and an
# uppercase letter, digit or opening quote. A small rule-based splitter: NLTK's punkt is not a
# dependency of this project.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences (newline-separated blocks are split too)."""
    sentences = []
    for block in text.splitlines():
        sentences.extend(s.strip() for s in _SENTENCE_END.split(block) if s.strip())
    return sentences


def output_prefix(prefix: str, key: str, sentences: bool) -> str:
    """Megatron's naming: ``my-gpt2_text_document`` or ``my-bert_text_sentence``."""
    return f"{prefix}_{key}_{'sentence' if sentences else 'document'}"


class DocumentEncoder:
    """Turns one JSON line into token sequences per key (runs in worker processes)."""

    def __init__(self, make_tokenizer: Callable[[], Any], keys: list[str], append_eod: bool, sentences: bool):
        self.make_tokenizer, self.keys, self.append_eod, self.sentences = make_tokenizer, keys, append_eod, sentences
        self.tokenizer = None

    def __call__(self, line: str) -> dict[str, list[list[int]]]:
        if self.tokenizer is None:
            self.tokenizer = self.make_tokenizer()
        doc = json.loads(line)
        out = {}
        for key in self.keys:
            if key not in doc:
                raise KeyError(f"JSON line has no key {key!r} (keys: {sorted(doc)})")
            pieces = split_sentences(doc[key]) if self.sentences else [doc[key]]
            seqs = [self.tokenizer.tokenize(p) for p in pieces]
            seqs = [s for s in seqs if s]
            if self.append_eod and seqs:
                seqs[-1].append(self.tokenizer.eod)
            out[key] = seqs
        return out


def _lines(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line


def encode_corpus(
    input_path: str,
    prefix: str,
    make_tokenizer: Callable[[], Any],
    vocab_size: int,
    json_keys: Iterable[str] = ("text",),
    append_eod: bool = False,
    sentences: bool = False,
    workers: int = 1,
    progress: bool = True,
) -> dict[str, str]:
    """Encode a JSON-lines file; return ``{json key: output prefix}`` of the written datasets."""
    keys = list(json_keys)
    encoder = DocumentEncoder(make_tokenizer, keys, append_eod, sentences)
    dtype = DType.optimal_dtype(vocab_size)
    prefixes = {k: output_prefix(prefix, k, sentences) for k in keys}
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)  # `--output-prefix data/x` with no data/
    builders = {k: IndexedDatasetBuilder(f"{p}.bin", dtype=dtype) for k, p in prefixes.items()}
    total = sum(1 for _ in _lines(input_path)) if progress else None  # a pass over the input, for the bar only
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    results = pool.imap(encoder, _lines(input_path), chunksize=32) if pool else map(encoder, _lines(input_path))
    try:
        from tqdm import tqdm

        bar = tqdm(results, total=total, unit="doc", disable=not progress, desc=f"encoding {input_path}")
        for encoded in bar:
            for key, seqs in encoded.items():
                for seq in seqs:
                    builders[key].add_item(torch.from_numpy(numpy.asarray(seq, dtype=numpy.int64)))
                builders[key].end_document()
    finally:
        if pool:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(f"{prefixes[key]}.idx")
    return prefixes
