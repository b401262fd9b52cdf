"""WideResNet (Zagoruyko & Komodakis, 2016) as an HF model: torchvision's bottleneck ResNet with
wider bottlenecks, written here because torchvision does not install beside the CPU torch.

Parameter names are torchvision's (``conv1``, ``layer1.0.conv2``, ``layer1.0.downsample.0``,
``fc`` ...), so a torchvision ``wide_resnet50_2`` state dict loads with ``load_state_dict``; the
defaults of :class:`WideResNetConfig` are that model. As an HF ``PreTrainedModel`` it has a config,
``save_pretrained`` / ``from_pretrained``, ``from_config`` on the meta device, and HF's per-module
initialiser, so the schedule language and the trainer treat it as any other HF model.

Two deliberate departures, neither of which changes a parameter: each stage's blocks are an
``nn.ModuleList`` (torchvision: ``nn.Sequential``), so every block is its own initialisation unit and
addressable as ``layer1.0``; and a block without a projection shortcut has an ``nn.Identity`` in its
``downsample`` place, so a schedule can place its shortcut as it places the projection.
``small_images`` swaps the 7x7 stride-2 stem and its max-pool for a 3x3 stride-1 stem, the usual
CIFAR-size variant.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention

EXPANSION = 4  # a bottleneck's output channels per plane


class WideResNetConfig(PretrainedConfig):
    """``layers``: blocks per stage (torchvision's four, or fewer); stage ``i`` has
    ``base_channels * 2**i`` planes and bottlenecks ``planes * width_per_group / 64`` channels wide
    (64 is a plain ResNet, 128 WideResNet-50-2)."""

    model_type = "wideresnet"

    def __init__(
        self,
        layers: tuple[int, ...] = (3, 4, 6, 3),
        width_per_group: int = 128,
        base_channels: int = 64,
        num_channels: int = 3,
        small_images: bool = False,
        **kwargs,
    ) -> None:
        if not 1 <= len(layers) <= 4:
            raise ValueError(f"layers: one to four stages (torchvision's layer1 ... layer4), not {len(layers)}")
        self.layers = list(layers)
        self.width_per_group = width_per_group
        self.base_channels = base_channels
        self.num_channels = num_channels
        self.small_images = small_images
        if "num_labels" not in kwargs and "id2label" not in kwargs:
            kwargs["num_labels"] = 1000  # ImageNet's, as torchvision's model
        super().__init__(**kwargs)

    @property
    def num_hidden_layers(self) -> int:  # blocks, as transformers count layers
        return sum(self.layers)

    @property
    def widths(self) -> list[int]:
        """Each stage's bottleneck width."""
        return [self.base_channels * 2**i * self.width_per_group // 64 for i in range(len(self.layers))]

    @property
    def channels(self) -> list[int]:
        """Each stage's output channels."""
        return [self.base_channels * 2**i * EXPANSION for i in range(len(self.layers))]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, each with BatchNorm; the shortcut added before the last ReLU."""

    def __init__(self, inplanes: int, planes: int, stride: int, width_per_group: int) -> None:
        super().__init__()
        width, out = planes * width_per_group // 64, planes * EXPANSION
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU()
        if stride != 1 or inplanes != out:
            self.downsample: nn.Module = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                                       nn.BatchNorm2d(out))  # fmt: skip
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + self.downsample(x))


class WideResNetPreTrainedModel(PreTrainedModel):
    config_class = WideResNetConfig
    base_model_prefix = "wideresnet"  # no base model: the classifier holds the layers, as torchvision's does
    main_input_name = "pixel_values"

    def _init_weights(self, module: nn.Module) -> None:
        """torchvision's: He-normal convolutions (fan out), unit BatchNorms, the Linear's own default."""
        if isinstance(module, nn.Conv2d):
            init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            init.ones_(module.weight)
            init.zeros_(module.bias)
            init.zeros_(module.running_mean)
            init.ones_(module.running_var)
            init.zeros_(module.num_batches_tracked)
        elif isinstance(module, nn.Linear):
            bound = module.in_features**-0.5
            init.uniform_(module.weight, -bound, bound)  # kaiming_uniform(a=sqrt(5)), as nn.Linear does
            init.uniform_(module.bias, -bound, bound)


class WideResNetForImageClassification(WideResNetPreTrainedModel):
    """Stem, four stages of bottleneck blocks, global average pool, linear classifier."""

    def __init__(self, config: WideResNetConfig) -> None:
        super().__init__(config)
        stem = config.base_channels
        if config.small_images:
            self.conv1 = nn.Conv2d(config.num_channels, stem, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(config.num_channels, stem, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU()
        inplanes = stem
        for i, blocks in enumerate(config.layers):
            planes = stem * 2**i
            stage = []
            for j in range(blocks):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(Bottleneck(inplanes, planes, stride, config.width_per_group))
                inplanes = planes * EXPANSION
            setattr(self, f"layer{i + 1}", nn.ModuleList(stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, config.num_labels)
        self.post_init()

    def layer_paths(self) -> list[str]:
        """Every block's path, in order: the units a schedule recomputes or splits."""
        return [f"layer{i + 1}.{j}" for i, blocks in enumerate(self.config.layers) for j in range(blocks)]

    def forward(self, pixel_values: torch.Tensor, **kwargs) -> ImageClassifierOutputWithNoAttention:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        for i in range(len(self.config.layers)):
            for block in getattr(self, f"layer{i + 1}"):
                x = block(x)
        return ImageClassifierOutputWithNoAttention(logits=self.fc(torch.flatten(self.avgpool(x), 1)))


AutoConfig.register(WideResNetConfig.model_type, WideResNetConfig)
AutoModelForImageClassification.register(WideResNetConfig, WideResNetForImageClassification)
