"""Checking a Megatron indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``) before training reads it.

megatron-core's ``IndexedDataset`` trusts its index: a corrupt one fails with a bare assertion or a
numpy error (and an "Exception ignored in __del__" trace from the half-built object), and token
ids that do not fit the model's vocabulary are not its concern at all — under tensor parallelism
they silently train on nothing, on one process they crash in the embedding. This module reads the
index itself, checks that it is consistent with its ``.bin``, and bounds the token ids, so every
such problem is one :class:`~megatron_slapo.errors.DataError` that names the file.

The layout (little-endian) is Megatron's: the magic ``MMIDIDX\\x00\\x00``, version 1 (u64), the
token dtype code (u8), the sequence count (u64), the document count (u64), then int32 sequence
lengths, int64 byte pointers into ``.bin``, and int64 document boundaries (indices of sequences).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from megatron_slapo.errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
_FIXED = len(INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequences, documents
# Megatron's dtype codes (megatron.core.datasets.indexed_dataset.DType): the integer ones hold tokens.
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
# A .bin up to this size is scanned whole for its largest token id; beyond it, evenly spaced windows
# of it are (a start-up check must not read a multi-GB file; a corrupt region of that size is caught).
FULL_SCAN_BYTES = 256 * 2**20
_WINDOWS, _WINDOW_TOKENS = 256, 2**16


@dataclass(frozen=True)
class IndexSummary:
    """What the index says about its dataset."""

    prefix: str
    dtype: np.dtype
    documents: int
    sequences: int
    tokens: int


def read_index(prefix: str) -> IndexSummary:
    """Check ``prefix.idx`` against Megatron's format and ``prefix.bin`` against the index."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"data prefix {prefix!r}: {path} does not exist")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_FIXED)
    if len(head) < len(INDEX_HEADER) + 8 or head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise DataError(f"{idx} is not a Megatron index (MMIDIDX v1): corrupt or another format")
    if len(head) < _FIXED:
        raise DataError(f"{idx} is corrupt: {size} bytes, shorter than the index header")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_HEADER) :])
    if version != 1:
        raise DataError(f"{idx} is not a Megatron index (MMIDIDX v1): version {version}")
    if code not in _TOKEN_DTYPES:
        raise DataError(f"{idx} is corrupt: dtype code {code} is not an integer token type")
    arrays = sequences * (4 + 8) + documents * 8
    if size not in (_FIXED + arrays, _FIXED + arrays + sequences):  # the second: with per-sequence modes
        raise DataError(
            f"{idx} is corrupt or truncated: its header promises {sequences} sequences and {documents - 1} "
            f"documents ({_FIXED + arrays} bytes), the file has {size} bytes"
        )
    data = np.memmap(idx, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(data, np.int32, sequences, _FIXED)
    pointers = np.frombuffer(data, np.int64, sequences, _FIXED + 4 * sequences)
    bounds = np.frombuffer(data, np.int64, documents, _FIXED + 12 * sequences)
    if documents < 2 or bounds[0] != 0 or bounds[-1] != sequences or np.any(np.diff(bounds) < 0):
        raise DataError(f"{idx} is corrupt: its document boundaries are not 0 <= ... <= {sequences}")
    width = np.dtype(_TOKEN_DTYPES[code]).itemsize
    if sequences and (
        np.any(lengths < 0) or pointers[0] != 0 or np.any(np.diff(pointers) != lengths[:-1].astype(np.int64) * width)
    ):
        raise DataError(f"{idx} is corrupt: its sequence pointers and lengths disagree")
    tokens = int(lengths.sum(dtype=np.int64))
    if tokens * width > os.path.getsize(bin_path):
        raise DataError(
            f"{bin_path} is shorter ({os.path.getsize(bin_path)} bytes) than its index says "
            f"({tokens * width} bytes): truncated?"
        )
    return IndexSummary(prefix, np.dtype(_TOKEN_DTYPES[code]), documents - 1, sequences, tokens)


def document_tokens(index: IndexSummary, first: int, last: int) -> int:
    """The tokens of documents ``first`` to ``last - 1``, as the index (checked by :func:`read_index`) counts them."""
    data = np.memmap(index.prefix + ".idx", mode="r", dtype=np.uint8)
    lengths = np.frombuffer(data, np.int32, index.sequences, _FIXED)
    bounds = np.frombuffer(data, np.int64, index.documents + 1, _FIXED + 12 * index.sequences)
    return int(lengths[bounds[first] : bounds[last]].sum(dtype=np.int64))


def token_id_range(index: IndexSummary) -> tuple[int, int, bool]:
    """(smallest, largest) token id in the ``.bin``, and whether every token was read to find them.

    A ``.bin`` over :data:`FULL_SCAN_BYTES` is sampled in evenly spaced windows, which costs the
    same whatever its size."""
    if index.tokens == 0:
        return 0, 0, True
    tokens = np.memmap(index.prefix + ".bin", mode="r", dtype=index.dtype, shape=(index.tokens,))
    if index.tokens * index.dtype.itemsize <= FULL_SCAN_BYTES:
        return int(tokens.min()), int(tokens.max()), True
    starts = np.linspace(0, index.tokens - _WINDOW_TOKENS, _WINDOWS, dtype=np.int64)
    windows = [tokens[s : s + _WINDOW_TOKENS] for s in starts]
    return min(int(w.min()) for w in windows), max(int(w.max()) for w in windows), False


def check_token_ids(index: IndexSummary, vocab_size: int, vocabulary: str) -> None:
    """DataError when the dataset holds ids outside ``[0, vocab_size)``: data made with another
    tokenizer, or a corrupt ``.bin``. The dtype's range settles it without reading when it fits."""
    info = np.iinfo(index.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    low, high, whole = token_id_range(index)
    if low < 0 or high >= vocab_size:
        where = "" if whole else " (in a sample of it)"
        raise DataError(
            f"{index.prefix}.bin holds token ids from {low} to {high}{where}, but the {vocabulary} has "
            f"{vocab_size} tokens: the data was made with another tokenizer, or is corrupt"
        )
