"""The auto-tuner: a search space (:mod:`.space`), the search that explains, prunes and runs it
(:mod:`.search`), and one trial as a subprocess runs it (:mod:`.trial`). ``tools/autotune.py`` is
the command."""

from megatron_slapo.tuning.space import Space

__all__ = ["Space"]
