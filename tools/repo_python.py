"""Run the entry points with the repository's ``.venv`` whatever ``python`` started them.

``tools/setup.sh`` installs everything into ``<repo>/.venv``; a command typed with another
interpreter (``python3 tools/explain.py``, the system's Python, which has no torch) would stop at
its first import. Every entry point (``pretrain_*.py``, ``tools/*.py``) therefore starts with

    if __name__ == "__main__":  # (in pretrain_*.py: ``import tools.repo_python``)
        import repo_python  # noqa: F401

and importing this module re-executes the same command line with ``<repo>/.venv/bin/python``
when, and only when, this interpreter cannot import torch and that venv exists (and is not this
interpreter). Otherwise it does nothing: an interpreter with torch (the venv itself, a GPU
machine's own Python, ``PYTHON=...`` in the shell scripts) runs the command as it was typed.
Standard library only, so that it works before any dependency is importable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Set for the re-executed process only (popped at once), so that a venv whose Python still
# cannot import torch fails on its import instead of re-executing itself forever.
_REEXECUTED = "MEGATRON_SLAPO_REEXECUTED"


def venv_python(root: Path = ROOT) -> Path | None:
    """``<root>/.venv/bin/python`` if a usable one is there, else None."""
    python = root / ".venv" / "bin" / "python"
    return python if os.access(python, os.X_OK) else None


def reexec_command(root: Path = ROOT) -> list[str] | None:
    """The command line to re-execute this process with, or None to carry on as it is."""
    if os.environ.pop(_REEXECUTED, None) or importlib.util.find_spec("torch") is not None:
        return None
    python = venv_python(root)
    if python is None or Path(sys.prefix).resolve() == (root / ".venv").resolve():
        return None
    # sys.orig_argv keeps the interpreter's own options and `-m module`; argv[0] is the script.
    return [str(python), *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]


def use_repo_venv() -> None:
    """Replace this process with the same command under the repo's venv, where :func:`reexec_command` says so."""
    command = reexec_command()
    if command is not None:
        os.environ[_REEXECUTED] = "1"
        os.execv(command[0], command)


use_repo_venv()
