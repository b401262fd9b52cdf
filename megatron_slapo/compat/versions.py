"""The package versions compat/ was written and tested against, checked once when megatron_slapo is imported.

Each function in compat/ reaches into a private name of one of these packages; a release outside
the tested range may have renamed or changed it. The check reads versions with importlib.metadata
(importing deepspeed or megatron-core would take seconds) and warns, one line per package, rather
than refusing: a newer release often still works, and the warning names what to suspect if not.
The ranges are requirements.txt's (tests/test_compat.py keeps the two equal).
"""

from __future__ import annotations

import importlib.metadata
import warnings

from packaging.specifiers import SpecifierSet

TESTED: dict[str, str] = {
    "torch": ">=2.11,<2.14",
    "transformers": ">=5.0,<6",
    "megatron-core": ">=0.16.1,<0.17",
    "deepspeed": ">=0.19,<0.20",
}


class UntestedVersionWarning(UserWarning):
    """An installed package is outside the range megatron_slapo/compat/ was tested against."""


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions() -> None:
    """Warn once per installed package whose version is outside :data:`TESTED`.

    A package that is not installed is left to fail where it is imported.
    """
    for package, tested in TESTED.items():
        version = installed_version(package)
        if version is not None and not SpecifierSet(tested).contains(version, prereleases=True):
            warnings.warn(
                f"{package} {version} is installed but megatron_slapo/compat/ was tested with {package}{tested}",
                UntestedVersionWarning,
                stacklevel=2,
            )
