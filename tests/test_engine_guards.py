"""What engines refuse before any compute, rather than train wrongly or fail deep inside a library."""

import pytest
import torch
from torch import nn

from megatron_slapo.engines.base import refuse_sequence_parallel
from megatron_slapo.errors import ConfigError
from tests.test_arguments import args_for


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's CPU accelerator is the one without fp16")
def test_deepspeed_fp16_on_cpu_is_refused_before_the_model_is_built():
    from megatron_slapo.engines.deepspeed_zero import _check_precision_supported, deepspeed_config

    def config(*flags):
        return deepspeed_config(args_for("--engine", "deepspeed", *flags), dp_size=2)

    _check_precision_supported(config("--bf16"))
    with pytest.raises(ConfigError, match="--engine deepspeed cannot train in fp16 on cpu"):
        _check_precision_supported(config("--fp16"))


def test_sequence_parallel_weights_are_refused_by_engines_that_do_not_reduce_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    refuse_sequence_parallel(model, "fsdp")
    model[1].weight.sequence_parallel = True
    with pytest.raises(ConfigError, match="--engine fsdp cannot reduce sequence-parallel gradients"):
        refuse_sequence_parallel(model, "fsdp")
