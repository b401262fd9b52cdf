"""What engines refuse before any compute, rather than train wrongly or fail deep inside a library."""

import pytest

from megatron_slapo.errors import ConfigError
from tests.test_arguments import args_for


@pytest.mark.parametrize("fp16_supported", [False, True], ids=["cpu-without-fp16", "cpu-with-avx512-fp16"])
def test_deepspeed_fp16_is_refused_where_the_accelerator_has_none(monkeypatch, fp16_supported):
    """Whether DeepSpeed's accelerator offers fp16 depends on the machine (its CPU accelerator asks
    oneDNN, which says yes on CPUs with avx512_fp16/AMX-FP16): control what it reports, test both."""
    from deepspeed.accelerator import get_accelerator

    from megatron_slapo.engines.deepspeed_zero import _check_precision_supported, deepspeed_config

    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: fp16_supported)
    monkeypatch.setattr(accelerator, "is_bf16_supported", lambda: True)

    def config(*flags):
        return deepspeed_config(args_for("--engine", "deepspeed", *flags), dp_size=2)

    _check_precision_supported(config("--bf16"))
    if fp16_supported:
        _check_precision_supported(config("--fp16"))
    else:
        with pytest.raises(ConfigError, match="--engine deepspeed cannot train in fp16 on"):
            _check_precision_supported(config("--fp16"))


@pytest.mark.parametrize("engine", ["megatron", "ddp", "fsdp"])
def test_what_bf16_means_on_the_engine_is_printed_at_start(engine, capsys):
    from megatron_slapo import parallel
    from megatron_slapo.engines import ENGINES
    from megatron_slapo.training.loop import pretrain
    from tests.test_bad_input import GPT, SIZES, TRAIN

    try:
        pretrain("gpt", [*GPT, *SIZES, *TRAIN, "--train-iters", "1", "--bf16", "--engine", engine])
    finally:
        parallel.destroy()
    story = ENGINES[engine].MIXED_PRECISION["bf16"]
    assert f"> --bf16 on --engine {engine}: {story}\n" in capsys.readouterr().out
    assert ("autocast over fp32 weights" in story) == (engine == "ddp")  # megatron: bf16 weights; FSDP: copies
