"""Which flags hold a value the user did not give: the embedded run's defaults and the model's flags
taken from the checkpoint in ``--load``. A check that refuses a flag asks here first, so that it
never blames the user for a value they did not pass (a T5 checkpoint's recorded
``--max-position-embeddings``, which validation filled in from ``--seq-length``, say)."""

from __future__ import annotations

import argparse


def chosen_for_user(args: argparse.Namespace) -> set[str]:
    """The flags whose values the embedded run (``args.embedded_defaults``) or the checkpoint in
    ``--load`` (``args.checkpoint_defaults``) chose."""
    return {*getattr(args, "embedded_defaults", {}), *getattr(args, "checkpoint_defaults", {})}


def user_gave(args: argparse.Namespace, name: str) -> bool:
    """Whether flag ``name`` holds a value, and the user's rather than one chosen for them."""
    return getattr(args, name, None) is not None and name not in chosen_for_user(args)
