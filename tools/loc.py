"""Lines of schedule code per model, Slapo's Table 4 method, beside Slapo's own numbers.

    .venv/bin/python tools/loc.py [--json]

A schedule's lines are the lines of its module that say how the model runs: every line holding
code, except the docstrings, comments and blank lines, the imports, the ``MODEL_TYPES`` declaration
(which models the schedule is for: metadata, not scheduling) and lines that only close a bracket.
A plan entry is one line, as a primitive call is in Slapo. Slapo's numbers are those of its paper
(ASPLOS'24, Table 4); a schedule that serves several of its models (``bert_tp``: BERT, RoBERTa and
ALBERT) is compared with each.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Python without torch re-runs this with the repo's .venv (tools/repo_python.py)
    import repo_python  # noqa: F401

import argparse
import ast
import inspect
import io
import json
import sys
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from schedules import SCHEDULES  # noqa: E402

# Slapo's Table 4: lines of schedule code per model.
SLAPO = {"bert": 21, "roberta": 21, "albert": 21, "gpt2": 10, "gpt_neo": 10, "opt": 10, "llama": 11, "t5": 11,
         "wideresnet": 12}  # fmt: skip
_SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                   tokenize.ENDMARKER, tokenize.ENCODING}  # fmt: skip
_CLOSING = {")", "]", "}", ","}


def _excluded_lines(tree: ast.Module) -> set[int]:
    """Line numbers of docstrings, imports and the MODEL_TYPES declaration."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MODEL_TYPES" for t in node.targets):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def count_lines(source: str) -> int:
    """Lines of schedule code in ``source`` (see the module docstring)."""
    excluded = _excluded_lines(ast.parse(source))
    tokens: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _SKIPPED_TOKENS:
            for line in range(tok.start[0], tok.end[0] + 1):
                tokens.setdefault(line, []).append(tok.string)
    return sum(1 for line, toks in tokens.items() if line not in excluded and not all(t in _CLOSING for t in toks))


def table() -> list[dict]:
    """One row per (schedule, model type it serves)."""
    rows = []
    for name, module in SCHEDULES.items():
        if not module.MODEL_TYPES:  # "default" schedules nothing
            continue
        lines = count_lines(inspect.getsource(module))
        for model_type in (t for t in module.MODEL_TYPES if t in SLAPO):  # the families Slapo scheduled
            slapo = SLAPO[model_type]
            rows.append({"schedule": name, "model": model_type, "lines": lines, "slapo": slapo,
                         "within": slapo is not None and lines <= slapo})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    rows = table()
    if p.parse_args().json:
        print(json.dumps(rows, indent=2))
        return
    print("| schedule | model | lines | Slapo (Table 4) | at or under Slapo's |")
    print("|---|---|---|---|---|")
    for r in rows:
        slapo = r["slapo"] if r["slapo"] is not None else "-"
        print(f"| {r['schedule']} | {r['model']} | {r['lines']} | {slapo} | {'yes' if r['within'] else 'no'} |")


if __name__ == "__main__":
    main()
