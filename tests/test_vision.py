"""pretrain_vision.py's parts that need no process group: the WideResNet model, the generated
image set, FLOPs per image, and the refusals of bad input (one line, before any compute)."""

import pytest
import torch

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.arguments.validation import validate_args
from megatron_slapo.data.images import PatternImages
from megatron_slapo.errors import ConfigError
from megatron_slapo.models.wideresnet import WideResNetConfig, WideResNetForImageClassification
from megatron_slapo.training.flops import flops_per_image
from megatron_slapo.training.model import auto_class, check_channels
from tests.test_bad_input import one_error_line

TRAIN = ["--train-iters", "2", "--eval-iters", "0"]


def test_defaults_are_torchvisions_wide_resnet50_2():
    """Its parameter count and torchvision's names: a torchvision state dict loads as it is."""
    with torch.device("meta"):
        model = WideResNetForImageClassification(WideResNetConfig())
    assert sum(p.numel() for p in model.parameters()) == 68_883_240  # torchvision's documented count
    names = list(model.state_dict())
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"] and names[-2:] == ["fc.weight", "fc.bias"]
    assert "layer1.0.downsample.0.weight" in names and "layer4.2.conv3.weight" in names
    assert not any("downsample" in n for n in names if n.startswith("layer1.1."))  # identity shortcuts hold nothing


def test_small_images_keep_their_resolution_through_the_stem():
    config = WideResNetConfig(layers=(1, 1), base_channels=8, width_per_group=32, small_images=True, num_labels=5)
    model = WideResNetForImageClassification(config).eval()
    assert model(torch.randn(2, 3, 16, 16)).logits.shape == (2, 5)
    assert model.layer_paths() == ["layer1.0", "layer2.0"]


def test_the_image_set_is_deterministic_and_balanced():
    train = PatternImages(400, "train", seed=1, height=16, width=16, channels=3, classes=4)
    again = PatternImages(400, "train", seed=1, height=16, width=16, channels=3, classes=4)
    valid = PatternImages(400, "valid", seed=1, height=16, width=16, channels=3, classes=4)
    assert torch.equal(train[7]["pixels"], again[7]["pixels"]) and train[7]["pixels"].shape == (3, 16, 16)
    assert not torch.equal(train[7]["pixels"], valid[7]["pixels"])
    counts = torch.bincount(torch.stack([train[i]["label"] for i in range(400)]), minlength=4)
    assert counts.min() > 60, counts


def test_flops_per_image_count_every_convolution():
    """Three times the forward's multiply-adds x 2: every convolution's (out, in, kernel) at its
    output's resolution, and the classifier."""
    config = WideResNetConfig(layers=(1, 1), base_channels=8, width_per_group=64, small_images=True, num_labels=5)
    model = WideResNetForImageClassification(config)
    forward = 0

    def count(module, inputs, output):
        nonlocal forward
        forward += 2 * module.weight.numel() * output[0, 0].numel()

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    model(torch.randn(1, 3, 12, 12))
    for hook in hooks:
        hook.remove()
    forward += 2 * model.fc.weight.numel()
    counted = flops_per_image(auto_class("vision"), config, 12, 12)
    assert counted == 3 * forward


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tensor-model-parallel-size", "3"], "world size 1 is not divisible by tensor (3) x pipeline (1) parallel "
         "sizes"),
        (["--pipeline-model-parallel-size", "2"], "world size 1 is not divisible by tensor (1) x pipeline (2) parallel "
         "sizes; --pipeline-model-parallel-size > 1: not supported for image models yet"),
        (["--sequence-parallel"], "--sequence-parallel splits what tensor parallelism replicates: it needs "
         "--tensor-model-parallel-size > 1"),
        (["--recompute-granularity", "full"], "recompute (--recompute-granularity, --checkpoint-ratio): not supported "
         "for image models yet"),
        (["--schedule", "gpt_tp"], "--schedule gpt_tp is for gpt2 models, not wideresnet; schedules that fit "
         "wideresnet: default, wideresnet_tp"),
        (["--resnet-layers", "2", "0"], "--resnet-layers takes one to four block counts (torchvision's stages), each "
         ">= 1"),
        (["--resnet-layers", "1", "1", "1", "1", "1"], "--resnet-layers takes one to four block counts (torchvision's "
         "stages), each >= 1"),
        (["--img-h", "0"], "--img-h 0 must be >= 1"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(argv, message, capsys):
    assert one_error_line("vision", [*TRAIN, *argv], capsys) == message


def test_a_pretrained_model_must_be_an_image_model_of_the_flags(tmp_path, capsys):
    config = WideResNetConfig(layers=(1,), base_channels=8, width_per_group=32, num_labels=3)
    WideResNetForImageClassification(config).save_pretrained(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    message = one_error_line("vision", [*TRAIN, "--load-hf", str(tmp_path)], capsys)
    assert message == "the model classifies 3 classes of 3-channel images, not --num-classes 10 of --num-channels 3"


def test_tensor_parallelism_must_split_every_stages_channels():
    config = WideResNetConfig(layers=(1, 1), base_channels=6, width_per_group=64)  # widths 6, 12; channels 24, 48
    check_channels(config, 2)
    with pytest.raises(
        ConfigError, match="--tensor-model-parallel-size 4 does not divide stage 1's 6 bottleneck width"
    ):
        check_channels(config, 4)


def test_sequence_parallelism_splits_the_batch_evenly():
    args = parse_args("vision", [*TRAIN, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--micro-batch-size", "3", "--global-batch-size", "6"])  # fmt: skip
    with pytest.raises(ConfigError, match="splits an image model's batch: --micro-batch-size 3 is not divisible"):
        validate_args(args, world_size=2)
