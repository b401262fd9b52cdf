"""Preprocess a JSON-lines corpus into Megatron's indexed dataset (.bin/.idx).

    .venv/bin/python tools/preprocess_data.py --input corpus.jsonl --json-keys text --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes ``my-gpt2_text_document.bin/.idx`` (``_text_sentence`` with ``--split-sentences``), the
files ``--data-path my-gpt2_text_document`` reads.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import os
import sys
import time
from functools import partial

from megatron_slapo.data.preprocess import encode_corpus
from megatron_slapo.data.tokenizers import TOKENIZER_TYPES, build_tokenizer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (for BERT)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-model")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        sys.exit(f"preprocess_data.py: error: --input {args.input} does not exist")
    make = partial(
        build_tokenizer, args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model, args.vocab_size
    )
    try:
        vocab_size = make().vocab_size
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"preprocess_data.py: error: {e}")
    start = time.time()
    prefixes = encode_corpus(
        args.input, args.output_prefix, make, vocab_size, args.json_keys, args.append_eod, args.split_sentences,
        args.workers, progress=not args.no_progress,
    )  # fmt: skip
    for key, prefix in prefixes.items():
        print(f"{key}: wrote {prefix}.bin and {prefix}.idx in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
