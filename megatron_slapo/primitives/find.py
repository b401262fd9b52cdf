"""``find``: locate subgraphs in this module's traced graphs (see :mod:`megatron_slapo.pattern`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from megatron_slapo.pattern import Subgraph, find_pattern, find_regex
from megatron_slapo.primitives.registry import primitive

if TYPE_CHECKING:
    from megatron_slapo.node import ScheduleNode


class FindMixin:
    @primitive
    def find(self: ScheduleNode, regex_or_pattern: str | re.Pattern | Callable | nn.Module) -> list[Subgraph]:
        """Find module calls whose path matches a regex, or occurrences of a pattern function's computation."""
        if isinstance(regex_or_pattern, (str, re.Pattern)):
            return find_regex(self, regex_or_pattern)
        if callable(regex_or_pattern):
            return find_pattern(self, regex_or_pattern)
        raise self._error(
            f"find() takes a regex or a pattern function, got {type(regex_or_pattern).__name__}", TypeError
        )
