"""Engines behind one seam (:mod:`.base`); ``--engine`` picks one from :data:`ENGINES`."""

from megatron_slapo.engines.ddp import DDPEngine

ENGINES = {"ddp": DDPEngine}

__all__ = ["ENGINES", "DDPEngine"]
