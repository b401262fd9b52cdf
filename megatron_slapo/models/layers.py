"""Where a model keeps its transformer layers: the paths that recompute, pipeline cuts, FSDP units
and the tensor-parallel plans address, found from the model itself."""

from __future__ import annotations

from torch import nn

from megatron_slapo.errors import ConfigError


def transformer_layers(model: nn.Module, num_layers: int) -> list[str]:
    """Paths of the model's transformer layers: the ModuleList with one entry per layer (the blocks
    of both stacks of an encoder-decoder; those a model lists itself, as WideResNet's stages)."""
    if hasattr(model, "layer_paths"):
        return model.layer_paths()
    if getattr(model.config, "is_encoder_decoder", False):  # T5: the encoder's blocks, then the decoder's
        stacks = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and p.endswith(".block")]
        return [f"{path}.{i}" for path, blocks in stacks for i in range(len(blocks))]
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return [f"{path}.{i}" for i in range(num_layers)]
    raise ConfigError(f"cannot find the {num_layers} transformer layers of {type(model).__name__}")


def shared_layers(model: nn.Module) -> list[str]:
    """Paths of the layer groups a model runs at several depths each (ALBERT's ``num_hidden_groups``
    groups for ``num_hidden_layers`` layers); empty for a model with a module per layer."""
    groups = getattr(model.config, "num_hidden_groups", None)
    if not groups or groups >= model.config.num_hidden_layers:
        return []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == groups:
            return [f"{path}.{i}" for i in range(groups)]
    return []
