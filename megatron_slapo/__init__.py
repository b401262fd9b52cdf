"""megatron_slapo: a schedule language for training HuggingFace transformers at scale.

sch = create_schedule(model)              # mirrors the module tree
sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)
sch["transformer.h.0.mlp.c_fc"].sync("bwd_post", "all_reduce")
model = build(sch)                        # materialise shard-locally
"""

import sys
import warnings

# megatron-core warns on import that apex / Transformer Engine are missing; we use torch-native paths.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron_slapo.compat.versions import UnsupportedVersionError, check_versions  # noqa: E402

# Before the imports below: a private name they reach may be what an unsupported version lacks.
# A refusal is one line, like every input error, rather than a traceback through the imports.
try:
    check_versions()
except UnsupportedVersionError as e:
    sys.exit(f"megatron_slapo: error: {e}")

from megatron_slapo.compat.torchao_float8 import quiet_torchao_import  # noqa: E402

quiet_torchao_import()  # transformers imports torchao (FP8's) when it is installed: its notes on a CPU are noise

from megatron_slapo.build import build  # noqa: E402
from megatron_slapo.errors import SchedulingError  # noqa: E402
from megatron_slapo.models import MODEL_CLASSES  # noqa: E402,F401  (registers them with transformers' Auto classes)
from megatron_slapo.primitives.registry import list_primitives  # noqa: E402
from megatron_slapo.schedule import Schedule, create_schedule, register_primitive  # noqa: E402
from megatron_slapo.verify import VerificationError, Verify  # noqa: E402

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
