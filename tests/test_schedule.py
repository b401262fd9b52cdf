"""The schedule tree and the primitive registry (single process)."""

import pytest
import torch
import transformers
from torch import nn

import megatron_slapo as ms
from megatron_slapo.parallel.state import default_group
from megatron_slapo.primitives import registry
from tests.utils import tiny_gpt2_config


@pytest.fixture
def gpt2():
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(tiny_gpt2_config())


def test_one_node_per_submodule_with_paths(gpt2):
    sch = ms.create_schedule(gpt2)
    assert [p for p, _ in sch.named_schedules()] == [p for p, _ in gpt2.named_modules()]
    mlp = sch["transformer.h.1.mlp"]
    assert mlp.mod is gpt2.transformer.h[1].mlp
    assert mlp.path == "transformer.h.1.mlp" and mlp.name == "mlp"
    assert mlp.parent is sch["transformer.h.1"] and mlp.root is sch
    assert sch["transformer.h"][1] is sch["transformer.h.1"]  # ModuleList children by index
    assert mlp["c_fc"] is sch["transformer.h.1.mlp.c_fc"]
    assert "transformer.h.0.attn" in sch and "transformer.h.7" not in sch
    # the default group: none in a fresh process; whatever an earlier in-process run left initialised
    assert sch[""] is sch and sch.group is default_group() and sch.world_size == 1


def test_unknown_path_names_the_closest_ones(gpt2):
    sch = ms.create_schedule(gpt2)
    with pytest.raises(KeyError, match=r"transformer\.h\.0\.attn") as err:
        sch["transformer.h.0.atn"]
    assert "closest existing paths" in str(err.value)
    with pytest.raises(KeyError, match="no submodule 'c_fcc' under 'transformer.h.0.mlp'"):
        sch["transformer.h.0.mlp"]["c_fcc"]


def test_create_schedule_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        ms.create_schedule("not a model")


def test_list_primitives_has_typed_methods_with_docs():
    prims = ms.list_primitives()
    for name in ("replace", "replace_all", "shard", "sync", "checkpoint", "hook", "fork_rng", "annotate"):
        assert prims[name], name
        assert getattr(ms.Schedule, name).__annotations__, name  # real, typed methods


def test_register_primitive_and_duplicate_check():
    def count_params(sch) -> int:
        """Number of parameters under this node."""
        return sum(p.numel() for p in sch.mod.parameters())

    try:
        ms.register_primitive(count_params)
        assert ms.create_schedule(nn.Linear(3, 2)).count_params() == 8
        assert ms.list_primitives()["count_params"] == "Number of parameters under this node."
        with pytest.raises(ValueError, match="already registered"):
            ms.register_primitive(count_params)
        with pytest.raises(ValueError, match="already registered"):
            ms.register_primitive(lambda sch: None, name="shard")
        with pytest.raises(ValueError, match="already an attribute"):
            ms.register_primitive(lambda sch: None, name="named_schedules")
    finally:
        registry._PRIMITIVES.pop("count_params", None)
        if hasattr(ms.Schedule, "count_params"):
            delattr(ms.Schedule, "count_params")


def test_auto_honours_the_styles_of_nine_in_ten_plan_entries_transformers_ships():
    """Counted over every config class transformers publishes a TP plan for, as installed; the
    families trained against one process (tests/distributed/test_auto.py) use every style honoured."""
    from transformers import CONFIG_MAPPING

    from megatron_slapo.plans.hf_plan import STYLES
    from tests.distributed.test_auto import ADDED, TRAINED

    def styles(family: str) -> list[str]:
        return list((getattr(CONFIG_MAPPING[family], "base_model_tp_plan", None) or {}).values())

    entries = [style for family in CONFIG_MAPPING for style in styles(family)]
    honoured = sum(style in STYLES for style in entries)
    assert honoured >= 0.9 * len(entries), (honoured, len(entries))
    trained = {style for family in (*TRAINED, *ADDED) for style in styles(family)}
    assert trained - set(STYLES) == {"embedding_rowwise"}  # the input embedding's, vocabulary-parallel anyway
    assert set(STYLES) <= trained


def test_explain_lists_what_each_module_received_once_per_kind_of_layer():
    """Schedule.explain(): a line per module a primitive touched, layers alike folded into one line
    with their number, a layer unlike the others on its own; nothing applied says so."""
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=3))
    sch = ms.create_schedule(model)
    assert sch.explain().splitlines()[1] == "(no primitive applied)"
    sch["transformer.h.0"].checkpoint()
    sch["transformer.h.2.mlp.act"].replace(nn.GELU(approximate="tanh"))
    for layer in range(3):
        sch[f"transformer.h.{layer}.mlp.c_fc"].shard("weight", axis=1)
        sch[f"transformer.h.{layer}.mlp.c_fc"].sync("bwd_post", "all_reduce")
    params = sum(p.numel() for p in model.parameters())
    assert sch.explain().splitlines() == [
        f"GPT2LMHeadModel: tensor-parallel rank 0 of 1; parameters here {params:,} of {params:,} (100%)",
        "transformer.h.0                checkpoint",
        "transformer.h.*.mlp.c_fc (x3)  column-parallel; shard weight axis 1: (32, 128) -> (32, 128); sync "
        "bwd_post all_reduce",
        "transformer.h.2.mlp.act        replaced NewGELUActivation by GELU",
    ]
