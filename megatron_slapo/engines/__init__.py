"""Engines behind one seam (:mod:`.base`); ``--engine`` picks one from :data:`ENGINES`."""

from megatron_slapo.engines.ddp import DDPEngine
from megatron_slapo.engines.deepspeed_zero import DeepSpeedEngine
from megatron_slapo.engines.fsdp import FSDPEngine
from megatron_slapo.engines.megatron_core import MegatronEngine

ENGINES = {"ddp": DDPEngine, "deepspeed": DeepSpeedEngine, "fsdp": FSDPEngine, "megatron": MegatronEngine}

__all__ = ["ENGINES", "DDPEngine", "DeepSpeedEngine", "FSDPEngine", "MegatronEngine"]
