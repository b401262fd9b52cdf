"""The Python and package versions megatron_slapo supports, the ones it was tested with, and the check of both.

Each function in compat/ reaches into a private name of one of these packages, written against the
:data:`TESTED` release; a release outside :data:`SUPPORTED` (the install ranges of requirements.txt,
which tests/test_compat.py keeps equal) is known or expected to break one of them, so the check
refuses it, naming the found version, the range and the tested one. A version inside the range but
other than the tested one gets a one-line note (:class:`UntestedVersionWarning`): it should work,
and the note says what to suspect if not.

``import megatron_slapo`` checks Python, torch, transformers and megatron-core (:data:`AT_IMPORT`);
DeepSpeed is checked where ``--engine deepspeed`` imports it, as only that engine uses it, and
torchao where FP8 is asked for (``--fp8-format``). Versions
are read with importlib.metadata: importing the packages would take seconds.
"""

from __future__ import annotations

import importlib.metadata
import platform
import warnings
from collections.abc import Iterable

from packaging.specifiers import SpecifierSet

# The install ranges (requirements.txt's; Python's from transformers 5, which requires 3.11, and
# megatron-core 0.16, which declares 3.10 to 3.12). transformers is capped at the minor release
# transformers_internals.py was written against: its private names change between minors.
SUPPORTED: dict[str, str] = {
    "python": ">=3.11,<3.13",
    "torch": ">=2.11,<2.14",
    "transformers": ">=5.0,<5.25",
    "megatron-core": ">=0.16.1,<0.17",
    "deepspeed": ">=0.19,<0.20",
    "torchao": ">=0.18,<0.19",
}
# What CI runs: the versions tools/setup.sh installs (Python: the series; any build of a release,
# such as torch's 2.13.0+cpu, is that release).
TESTED: dict[str, str] = {
    "python": "3.11",
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "megatron-core": "0.16.1",
    "deepspeed": "0.19.8",
    "torchao": "0.18.0",
}
AT_IMPORT = ("python", "torch", "transformers", "megatron-core")


class UnsupportedVersionError(ImportError):
    """An installed package (or Python) is outside the range megatron_slapo supports; the message is one line."""


class UntestedVersionWarning(UserWarning):
    """An installed package (or Python) is inside the supported range but not the version CI tested."""


def installed_version(package: str) -> str | None:
    """The running Python's version for ``"python"``, else the installed distribution's, or None when it is not installed."""
    if package == "python":
        return platform.python_version()
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _remedy(packages: list[str]) -> str:
    """What to do about the unsupported ``packages``: a Python of the tested series, or pip installs of the tested releases."""
    if "python" in packages:  # a new venv for that Python installs the tested packages too
        return f"use Python {TESTED['python']} (PYTHON=python{TESTED['python']} bash tools/setup.sh, for a new .venv)"
    versions = " ".join(f"'{package}=={TESTED[package]}'" for package in packages)
    return f"install the tested version{'s' if len(packages) > 1 else ''}: pip install {versions}"


def check_versions(packages: Iterable[str] = AT_IMPORT) -> None:
    """Refuse ``packages`` outside :data:`SUPPORTED`, all in one line (:class:`UnsupportedVersionError`);
    note, one line each, those inside it but other than :data:`TESTED`.

    A package that is not installed is left to fail where it is imported.
    """
    unsupported, problems = [], []
    for package in packages:
        version = installed_version(package)
        if version is None:
            continue
        name, supported, tested = "Python" if package == "python" else package, SUPPORTED[package], TESTED[package]
        if not SpecifierSet(supported).contains(version, prereleases=True):
            unsupported.append(package)
            problems.append(f"{name} {version} is outside the supported range {supported} (tested: {tested})")
        elif not SpecifierSet(f"=={tested}.*").contains(version, prereleases=True):
            warnings.warn(
                f"{name} {version} is supported ({supported}) but untested; megatron_slapo was tested with {tested}",
                UntestedVersionWarning,
                stacklevel=2,
            )
    if problems:
        raise UnsupportedVersionError(f"{', '.join(problems)}; {_remedy(unsupported)}")
