"""argparse's private names (the standard library's, which follows Python's version).

Written against Python 3.10 to 3.12.
"""

from __future__ import annotations

import argparse


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every action (flag) the parser knows, with its ``dest`` and ``option_strings``:
    ``parser._actions``. argparse has no public way to list them. Python 3.10 to 3.12."""
    return parser._actions
