"""megatron_slapo: a schedule language for training HuggingFace transformers at scale.

sch = create_schedule(model)              # mirrors the module tree
sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)
sch["transformer.h.0.mlp.c_fc"].sync("bwd_post", "all_reduce")
model = build(sch)                        # materialise shard-locally
"""

from megatron_slapo.build import build
from megatron_slapo.metadata import SchedulingError
from megatron_slapo.primitives.registry import list_primitives, register_primitive
from megatron_slapo.schedule import Schedule, create_schedule
from megatron_slapo.verify import VerificationError, Verify

__version__ = "0.1.0"

__all__ = [
    "create_schedule",
    "build",
    "Verify",
    "Schedule",
    "SchedulingError",
    "VerificationError",
    "list_primitives",
    "register_primitive",
    "__version__",
]
