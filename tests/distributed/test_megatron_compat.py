"""megatron-core's own tensor-parallel layers run on this CPU-only machine after initialize()."""

import torch

from megatron_slapo.compat import megatron_cpu as cpu_compat
from tests.utils import max_diff


def test_megatron_column_parallel_linear_with_gather_output(group, rank, world):
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    assert cpu_compat.is_applied() == (not torch.cuda.is_available())
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 16)
    layer = tensor_parallel.ColumnParallelLinear(
        8, 16, config=cfg, init_method=torch.nn.init.zeros_, bias=True, gather_output=True
    )
    with torch.no_grad():
        layer.weight.copy_(ref.weight.chunk(world, 0)[rank])
        layer.bias.copy_(ref.bias.chunk(world, 0)[rank])
    x = torch.randn(3, 2, 8)
    out, _ = layer(x)  # gather_output allocates on torch.cuda.current_device(): the CPU shim
    assert max_diff(out, ref(x)) < 1e-6
