"""Check, before any compute, that the paths a run will write can be written.

A run that finds out only when it first writes (a ``--save`` that names a file, a TensorBoard
directory under a read-only parent) loses everything it computed until then. The checks here
create nothing that outlives them: a directory that does not exist yet is left to the writer to
create (so a run that then fails validation leaves no empty directory behind); whether it *could*
be created is tested by writing, and at once removing, a probe file in its nearest existing
ancestor, which is what the writer's ``os.makedirs`` will need.
"""

from __future__ import annotations

import os
import tempfile

from megatron_slapo.errors import ConfigError


def _probe_writable(flag: str, path: str, directory: str) -> None:
    """Raise unless a file can be created in the existing directory ``directory``."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    except OSError as e:
        where = "" if os.path.abspath(directory) == os.path.abspath(path) else f" (in {directory})"
        raise ConfigError(f"{flag} {path}: cannot write there{where}: {e.strerror or e}; give a writable path") from e
    os.close(fd)
    os.unlink(probe)


def _existing_ancestor(flag: str, path: str) -> str:
    """The nearest ancestor of the missing ``path`` that exists; raise if it is not a directory."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConfigError(f"{flag} {path}: {ancestor} is a file, not a directory; give another path")
    return ancestor


def check_output_dir(flag: str, path: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``flag`` and ``path`` unless ``path`` is a
    directory this process can write into, or can be created as one (its parents included)."""
    if not path:
        raise ConfigError(f"{flag} needs a directory, got an empty path")
    if os.path.isdir(path):
        _probe_writable(flag, path, path)
    elif os.path.exists(path) or os.path.islink(path):
        raise ConfigError(f"{flag} {path} is a file, but {flag} needs a directory: give another path")
    else:
        _probe_writable(flag, path, _existing_ancestor(flag, path))


def check_output_file(flag: str, path: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``flag`` and ``path`` unless the file ``path``
    can be written: an existing file open for writing, or a new one in a directory that exists or
    can be created. A missing parent directory is for the writer to create
    (``os.makedirs(os.path.dirname(path) or ".", exist_ok=True)``) before it opens the file."""
    if not path:
        raise ConfigError(f"{flag} needs a file path, got an empty path")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory, but {flag} needs a file: give a file path")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag} {path}: the file is not writable; give another path")
        return
    parent = os.path.dirname(os.path.abspath(path))
    _probe_writable(flag, path, parent if os.path.isdir(parent) else _existing_ancestor(flag, path))
