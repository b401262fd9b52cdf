"""GPT, BERT and T5 training datasets from Megatron indexed data, via megatron-core.

megatron-core's ``BlendedMegatronDatasetBuilder`` builds the splits and blends, ``GPTDataset``
the document/sample/shuffle indices (cached, deterministic by seed) and
``BERTMaskedWordPieceDataset`` the 15% 80/10/10 masking and sentence-order pairs,
``T5MaskedWordPieceDataset`` the span corruption. What this
module adds is checking the inputs first, so a bad prefix, a corrupt ``.idx`` or a split with no
documents is one clear error rather than an assertion (or, for an empty split, an endless loop
inside megatron-core) after the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_slapo.data.indexed import IndexSummary, check_token_ids, document_tokens, read_index
from megatron_slapo.errors import DataError


@dataclass(frozen=True)
class SplitSizes:
    """Samples wanted from each split (Megatron's train/valid/test)."""

    train: int
    valid: int
    test: int

    def as_list(self) -> list[int]:
        return [self.train, self.valid, self.test]


@dataclass(frozen=True)
class Corpus:
    """What a language run's datasets are built from beyond the data flags, as the trainer decided
    it: the prefixes (``--data-path``, or the embedded corpus's; None with ``--mock-data``), the
    samples' length (``--seq-length``, or the model's positions), and the ids the model has rows
    for, with where that number comes from (named when the data holds larger ids)."""

    data_path: list[str] | None
    seq_length: int
    vocab_size: int
    vocabulary: str  # "tokenizer (GPT2BPETokenizer)", "model in --load-hf DIR"


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path PREFIX [PREFIX ...]`` or a blend ``W1 PREFIX1 W2 PREFIX2 ...``."""
    from megatron.core.datasets.utils import get_blend_from_list

    try:
        prefixes, weights = get_blend_from_list(data_path)
    except (AssertionError, ValueError) as e:
        raise DataError(f"--data-path must be PREFIX ... or W1 PREFIX1 W2 PREFIX2 ...: {e}") from e
    return list(prefixes), (list(weights) if weights else None)


def _checked_index(prefix: str, vocab_size: int | None, vocabulary: str) -> IndexSummary:
    index = read_index(prefix)
    if index.documents == 0:
        raise DataError(f"{prefix} contains no documents")
    if index.tokens == 0:
        raise DataError(f"{prefix}: its {index.documents} documents are all empty (no tokens): was the JSON key "
                        "given to preprocess_data.py --json-keys the one that holds the text?")  # fmt: skip
    if vocab_size is not None:
        check_token_ids(index, vocab_size, vocabulary)
    return index


def check_prefix(prefix: str, vocab_size: int | None = None, vocabulary: str = "tokenizer") -> int:
    """Check that ``prefix.bin``/``prefix.idx`` exist, agree, hold tokens, and (given ``vocab_size``)
    only token ids below it; return the number of documents."""
    return _checked_index(prefix, vocab_size, vocabulary).documents


def check_splits(
    prefixes: list[str], split: str, sizes: SplitSizes, vocab_size: int | None = None, vocabulary: str = "tokenizer"
) -> str:
    """Check that every split that must yield samples gets tokens of every dataset.

    megatron-core builds every split with a nonzero weight and loops forever on one that holds no
    tokens (no documents, or only empty ones), even when no samples are wanted from it. Such a
    split (empty and unused, typically the 1% test split of a small corpus) gets weight 0 in the
    returned split string; so does an empty test split (the trainer then skips the test
    evaluation, the only thing that reads it); an empty train or valid split that is needed is an
    error.
    """
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    vector = parse_and_normalize_split(split)
    matrix = convert_split_vector_to_split_matrix(vector)
    for prefix in prefixes:
        index = _checked_index(prefix, vocab_size, vocabulary)
        n_docs = index.documents
        for i, (name, bounds, wanted) in enumerate(
            zip(("train", "valid", "test"), matrix, sizes.as_list(), strict=True)
        ):
            first, last = (0, 0) if bounds is None else (round(bounds[0] * n_docs), round(bounds[1] * n_docs))
            empty = document_tokens(index, first, last) == 0
            if empty and wanted > 0 and name != "test":
                what = "empty" if first == last else f"{last - first} documents with no tokens"
                raise DataError(
                    f"--split {split} leaves the {name} split of {prefix} ({n_docs} documents) {what}, but "
                    f"{wanted} {name} samples are needed; change --split, or --eval-iters 0 for no evaluation"
                )
            if empty and bounds is not None:
                vector[i] = 0.0
    return ",".join(f"{v:g}" for v in vector)


def _common_config(args: Any, tokenizer: Any, corpus: Corpus, prefixes: list[str], weights: list[float] | None,
                   split: str) -> dict:  # fmt: skip
    return dict(
        random_seed=args.seed,
        sequence_length=corpus.seq_length,
        blend=(prefixes, weights) if prefixes else None,
        split=split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        mmap_bin_files=True,
    )


def build_gpt_datasets(args: Any, tokenizer: Any, corpus: Corpus, sizes: SplitSizes) -> tuple:
    """train/valid/test ``GPTDataset`` (or megatron-core's mock data with ``--mock-data``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    prefixes, weights = ([], None) if args.mock_data else parse_data_path(corpus.data_path)
    split = check_splits(prefixes, args.split, sizes, corpus.vocab_size, corpus.vocabulary) if prefixes else args.split
    config = GPTDatasetConfig(
        **_common_config(args, tokenizer, corpus, prefixes, weights, split),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # the trainer builds masks from the tokens (training/tasks.py)
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes.as_list(), lambda: True, config).build()


def _check_word_piece(args: Any, tokenizer: Any, what: str) -> None:
    """What megatron-core's masked datasets (BERT, T5) need of the data and the tokenizer."""
    if args.mock_data:
        raise DataError(f"--mock-data is only available for GPT; give pretrain_{args.task}.py a --data-path")
    for name in ("cls", "sep", "mask", "pad"):
        if getattr(tokenizer, name, None) is None:
            raise DataError(f"{what} needs a tokenizer with a [{name.upper()}] token; use BertWordPiece*")
    if tokenizer.pad != 0:
        # megatron-core's masked datasets write the pad id into the padding mask: only id 0 masks padding.
        raise DataError(
            f"{what} data needs the [PAD] token at id 0 (Megatron's convention); this vocabulary has {tokenizer.pad}"
        )


def _masked_config(args: Any, tokenizer: Any, corpus: Corpus, sizes: SplitSizes, what: str, max_ngram: int,
                   geometric: bool) -> dict:  # fmt: skip
    """The fields megatron-core's masked datasets share: the data, its split, and Megatron's
    masking (--mask-prob of the tokens, whole words, n-grams up to ``max_ngram`` long)."""
    _check_word_piece(args, tokenizer, what)
    prefixes, weights = parse_data_path(corpus.data_path)
    split = check_splits(prefixes, args.split, sizes, corpus.vocab_size, corpus.vocabulary)
    return dict(
        **_common_config(args, tokenizer, corpus, prefixes, weights, split),
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_max_ngram=max_ngram,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=geometric,
    )


def build_bert_datasets(args: Any, tokenizer: Any, corpus: Corpus, sizes: SplitSizes) -> tuple:
    """train/valid/test ``BERTMaskedWordPieceDataset`` (MLM 15%: 80/10/10; sentence-order pairs)."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    masked = _masked_config(args, tokenizer, corpus, sizes, "BERT", 3, geometric=False)
    config = BERTMaskedWordPieceDatasetConfig(**masked, classification_head=args.bert_binary_head)
    return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, sizes.as_list(), lambda: True, config).build()


def build_t5_datasets(args: Any, tokenizer: Any, corpus: Corpus, sizes: SplitSizes) -> tuple:
    """train/valid/test ``T5MaskedWordPieceDataset``: Megatron's span corruption (15% of the tokens
    in spans of 1 to 10, geometrically distributed), each span a sentinel in the encoder's input
    and the sentinel then the span in the decoder's."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig

    if not getattr(tokenizer, "extra_tokens", None):
        raise DataError("T5 needs sentinel tokens: give --vocab-extra-ids (Megatron's T5 runs use 100)")
    config = T5MaskedWordPieceDatasetConfig(**_masked_config(args, tokenizer, corpus, sizes, "T5", 10, geometric=True),
                                            sequence_length_decoder=args.decoder_seq_length)  # fmt: skip
    return BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, sizes.as_list(), lambda: True, config).build()
