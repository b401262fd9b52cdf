"""Train a tokenizer on local text for Megatron's tokenizer types.

    .venv/bin/python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 8192 --output-dir tok/
    .venv/bin/python tools/train_tokenizer.py --input corpus.txt --type wordpiece --vocab-size 8192 --output-dir tok/

``bpe`` writes vocab.json + merges.txt (``--tokenizer-type GPT2BPETokenizer``); ``wordpiece``
writes vocab.txt (``BertWordPieceLowerCase``, or ``BertWordPieceCase`` with --cased). Input is
JSON lines (``--json-key``, default text) or plain text.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import json
import os
import sys
from collections.abc import Iterator

from megatron_slapo.data.tokenizer_training import saved_vocab_size, train_bpe, train_wordpiece


def texts(path: str, key: str) -> Iterator[str]:
    jsonl = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)[key] if jsonl else line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, nargs="+")
    p.add_argument("--json-key", default="text")
    p.add_argument("--type", choices=("bpe", "wordpiece"), required=True)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--cased", action="store_true", help="wordpiece: keep case (BertWordPieceCase)")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args(argv)
    missing = [f for f in args.input if not os.path.isfile(f)]
    if missing:
        sys.exit(f"train_tokenizer.py: error: no such input file: {', '.join(missing)}")
    corpus = (t for f in args.input for t in texts(f, args.json_key))
    if args.type == "bpe":
        files = train_bpe(corpus, args.vocab_size, args.output_dir)
        kind = "GPT2BPETokenizer"
    else:
        files = train_wordpiece(corpus, args.vocab_size, args.output_dir, lowercase=not args.cased)
        kind = "BertWordPieceCase" if args.cased else "BertWordPieceLowerCase"
    size = saved_vocab_size(files)
    if size < args.vocab_size:  # the trainer stops silently when the corpus runs out of merges
        print(
            f"note: the corpus gives {size:,} tokens, fewer than --vocab-size {args.vocab_size}: "
            f"the tokenizer has {size:,}"
        )
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in files.items())
    print(f"trained a {size:,}-token vocabulary; use: --tokenizer-type {kind} {flags}")


if __name__ == "__main__":
    main()
