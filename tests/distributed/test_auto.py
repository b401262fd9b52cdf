"""--schedule auto: the HF plan of each family, translated, reproduces the unscheduled model under TP2
(Verify: outputs and every gradient), with and without sequence parallelism."""

import argparse
import copy
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

import megatron_slapo as ms
from megatron_slapo.errors import SchedulingError
from megatron_slapo.models.layers import transformer_layers
from megatron_slapo.parallel.collectives import gather_tensor
from megatron_slapo.plans.gathered_outputs import SplitRMSNorm
from megatron_slapo.plans.hf_plan import NO_SEQUENCE_PARALLEL
from megatron_slapo.plans.sequence import split_layers
from schedules import auto, llama_tp
from tests.distributed.families import saved_configs, tiny
from tests.distributed.runs import PARITY, assert_parity, layout_case, reference_losses, train_losses
from tests.utils import max_diff

FAMILIES = auto.MODEL_TYPES  # each built from its tiny config (families.py)
# Verified split along the sequence in the default tier (the others in the slow one): a family of each
# kind (rotary, packed q|k|v, biases, parallel blocks, experts, latent attention, Gemma's embedding,
# Phi-3's packed projections, OLMo 2's split norms, a completed plan) and the refused ones
SEQUENCE_DEFAULT = ("llama", "qwen3", "starcoder2", "gpt_neox", "phi", "mixtral", "qwen3_moe", "deepseek_v3",
                    "gemma3_text", "phi3", "olmo2", "granitemoe", *NO_SEQUENCE_PARALLEL)  # fmt: skip


@pytest.mark.parametrize("family, sequence_parallel", [
    pytest.param(family, sp, id=f"{family}-{'tp-sp' if sp else 'tp'}",
                 marks=[pytest.mark.slow] if sp and family not in SEQUENCE_DEFAULT else [])
    for family in FAMILIES for sp in (False, True)
])  # fmt: skip
def test_auto_matches_the_unscheduled_model(group, family, sequence_parallel):
    config = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    sch = ms.create_schedule(model, group)
    if sequence_parallel and family in NO_SEQUENCE_PARALLEL:  # refused, with the reason
        with pytest.raises(SchedulingError, match=f"cannot split {family} along the sequence"):
            auto.apply(sch, config, argparse.Namespace(sequence_parallel=True))
        return
    with ms.Verify(sch, [ids], seed=7) as verify:
        auto.apply(sch, config, argparse.Namespace(sequence_parallel=sequence_parallel))
        if sequence_parallel:
            split_layers(sch, transformer_layers(model, config.num_hidden_layers))
    assert verify.report.grads and not verify.report.failures, verify.report.failures
    sharded = [path for path, node in sch.named_schedules() if node.metadata.shards]
    assert len(sharded) >= 4 * config.num_hidden_layers, sharded


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mixtral"])  # plain, per-head norms, biases, MoE
@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager repeats each key/value head by the module's count
def test_fewer_key_value_heads_than_ranks_are_shared_as_megatron_shares_them(
    group, family, sequence_parallel, attention
):
    """One key/value head for two ranks (multi-query attention at TP2): each rank computes half of
    it, all-gathers it and keeps it whole, and the gradient reduce-scatters back."""
    config = tiny(family)
    config.num_key_value_heads = 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    sch = ms.create_schedule(model, group)
    with ms.Verify(sch, [ids], seed=7) as verify:
        auto.apply(sch, config, argparse.Namespace(sequence_parallel=sequence_parallel))
        if sequence_parallel:
            split_layers(sch, transformer_layers(model, config.num_hidden_layers))
    assert verify.report.grads and not verify.report.failures, verify.report.failures
    k_proj = model.model.layers[0].self_attn.k_proj
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert k_proj.weight.shape[0] == head_dim // sch.world_size  # split, not copied


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_auto_places_llama_as_its_hand_written_schedule_does(group, sequence_parallel):
    """From HF's plan, the shards (parameter, axis, stride, shape) and collectives of llama_tp, the
    schedule written by hand for Llama (test_comm_log.py counts their bytes per step: equal too)."""
    config, args = tiny("llama"), argparse.Namespace(sequence_parallel=sequence_parallel)
    placements = []
    for schedule in (llama_tp, auto):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        sch = ms.create_schedule(model, group)
        schedule.apply(sch, config, args)
        placements.append({path: (node.metadata.shards, node.metadata.syncs, node.metadata.sequence_split)
                           for path, node in sch.named_schedules() if node.metadata.shards or node.metadata.syncs})  # fmt: skip
        placements.append(
            {name: (p.shape, getattr(p, "sequence_parallel", False)) for name, p in model.named_parameters()}
        )
    assert placements[0] == placements[2] and placements[1] == placements[3]
    # per layer q, k, v, o, gate, up, down and the two blocks; the embedding, the head (and the final norm's gather)
    assert len(placements[0]) == 9 * config.num_hidden_layers + 2 + sequence_parallel


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_auto_on_pretrained_weights_reproduces_the_logits(group, rank, family, tmp_path_factory):
    """save_pretrained weights (of a dense and of an MoE family), scheduled by auto at TP2: the
    logits, gathered along the vocabulary, are the original model's (tools/convert_checkpoint.py's
    round trip of the same weights is in test_trainer.py)."""
    config = tiny(family)
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = [str(tmp_path_factory.mktemp(family)) if rank == 0 else None]
    if rank == 0:
        original.save_pretrained(path[0])
    dist.broadcast_object_list(path, src=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path[0]).eval()
    sch = ms.create_schedule(model, group)
    auto.apply(sch, model.config)
    ms.build(sch)  # pretrained weights are real: build keeps them
    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = gather_tensor(model(ids).logits, -1, group)
        assert max_diff(logits, original(ids).logits) < 1e-5


def test_a_parameter_the_plan_leaves_replicated_in_a_region_is_refused(group):
    """Phi with q/k layer norms: they see this rank's heads only, and the plan says nothing of them."""
    config = tiny("phi")
    config.qk_layernorm = True
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SchedulingError, match=r"model.layers.0.self_attn.q_layernorm.weight is replicated inside"):
        auto.apply(ms.create_schedule(model, group), config)


@pytest.mark.parametrize("family, refusal", [
    ("inkling2_text", r"plans 'embed_tokens' as 'replicate', which it cannot honour yet"),
    ("granite_swa", r"plans 'layers.\*.self_attn.sinks' as 'colwise', and no module of this model has that path"),
])  # fmt: skip
def test_a_style_auto_cannot_honour_is_one_error_naming_it(group, family, refusal):
    config = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SchedulingError, match=refusal):
        auto.apply(ms.create_schedule(model, group), config)


@pytest.mark.parametrize("family", ["olmo2", "phi3", "glm4"])
def test_gathered_projections_are_split_as_megatron_splits_them(group, family):
    """Where HF's plan gathers q/k/v or gate|up whole (colwise_gather_output), the block is split by
    heads and features instead: one input-gradient all-reduce per block and one output all-reduce,
    packed projections strided (each rank its heads' q, k and v; its features' gate and up), OLMo 2's
    q/k norms over all heads split with them; nothing gathered."""
    config = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = ms.create_schedule(model, group)
    auto.apply(sch, config)
    syncs = {path.removeprefix("model.layers.0."): node.metadata.syncs for path, node in sch.named_schedules()
             if path.startswith("model.layers.0.") and node.metadata.syncs}  # fmt: skip
    assert syncs == {"self_attn": {("bwd_post", "all_reduce")}, "self_attn.o_proj": {("fwd_post", "all_reduce")},
                     "mlp": {("bwd_post", "all_reduce")}, "mlp.down_proj": {("fwd_post", "all_reduce")}}  # fmt: skip
    shards = {path.removeprefix("model.layers.0."): {n: spec.stride for n, spec in node.metadata.shards.items()}
              for path, node in sch.named_schedules() if path.startswith("model.layers.0.") and node.metadata.shards}  # fmt: skip
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    expected = {"olmo2": {"self_attn.q_norm": {"weight": 1}, "self_attn.k_norm": {"weight": 1}},
                "phi3": {"self_attn.qkv_proj": {"weight": (heads, kv, kv)}, "mlp.gate_up_proj": {"weight": 2}},
                "glm4": {"mlp.gate_up_proj": {"weight": 2}}}[family]  # fmt: skip
    assert {path: shards[path] for path in expected} == expected, shards


def test_outputs_the_plan_gathers_without_splitting_them_again_are_gathered_as_it_says(group):
    """Qwen3-Next's linear attention: its plan gathers in_proj_qkvz's, in_proj_ba's and out_proj's outputs
    and no row-parallel layer splits them again, so each is split by columns, its output all-gathered
    (each rank then runs the whole module) and its input gradient all-reduced; its attention layers
    are split as Megatron splits them."""
    config = tiny("qwen3_next")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = ms.create_schedule(model, group)
    auto.apply(sch, config)
    linear = sch["model.layers.0.linear_attn"]
    syncs = {path: node.metadata.syncs for path, node in linear.named_schedules() if node.metadata.syncs}
    gathered = {("fwd_post", "all_gather"), ("bwd_post", "all_reduce")}
    assert syncs == {"in_proj_qkvz": gathered, "in_proj_ba": gathered, "out_proj": gathered}, syncs
    assert sch["model.layers.1.self_attn"].metadata.syncs == {("bwd_post", "all_reduce")}


def test_a_full_width_norm_over_key_value_heads_the_ranks_share_is_refused(group):
    """OLMo 2's k_norm spans every key/value head: with one head for two ranks (each computing it
    whole) no split of the norm gives each rank whole heads."""
    config = tiny("olmo2")
    config.num_key_value_heads = 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        SchedulingError,
        match=r"k_norm\] it normalises 1 heads together, and the tensor-parallel size 2 does not divide",
    ):
        auto.apply(ms.create_schedule(model, group), config)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])  # with a query rank (q_b_proj), without (q_proj)
def test_latent_attention_is_split_by_heads_as_megatron_splits_it(group, family):
    """MLA: the up-projections split by output heads, o_proj by input heads, the low-rank
    down-projections and their norms whole with their gradients summed over the ranks, the
    module's head count divided, and one input-gradient all-reduce for the whole block."""
    config = tiny(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    sch = ms.create_schedule(model, group)
    auto.apply(sch, config)
    tp, heads = sch.world_size, config.num_attention_heads
    attention = model.model.layers[0].self_attn
    q_proj = "q_b_proj" if config.q_lora_rank else "q_proj"
    up = {q_proj: config.qk_nope_head_dim + config.qk_rope_head_dim,  # each head's [nope | rope] query
          "kv_b_proj": config.qk_nope_head_dim + config.v_head_dim}  # each head's [k nope | v]  # fmt: skip
    for name, width in up.items():
        assert getattr(attention, name).weight.shape[0] == heads // tp * width
    assert attention.o_proj.weight.shape[1] == heads // tp * config.v_head_dim and attention.num_heads == heads // tp
    whole = {name: p for name, p in attention.named_parameters() if name.split(".")[0] not in (*up, "o_proj")}
    assert len(whole) == (4 if config.q_lora_rank else 2)  # q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm
    assert all(getattr(p, "sequence_parallel", False) for p in whole.values()), whole.keys()
    block = sch["model.layers.0.self_attn"]
    syncs = {path: node.metadata.syncs for path, node in block.named_schedules() if node.metadata.syncs}
    assert syncs == {"": {("bwd_post", "all_reduce")}, "o_proj": {("fwd_post", "all_reduce")}}


def test_latent_attention_with_heads_the_tp_size_does_not_divide_is_one_error(group):
    config = tiny("deepseek_v3")
    config.num_attention_heads = config.num_key_value_heads = 3
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(SchedulingError, match=r"self_attn\] num_heads=3 is not divisible by the tensor-parallel size"):
        auto.apply(ms.create_schedule(model, group), config)


# Trained 10 steps against one process: GQA wherever the family has it (--num-query-groups 2), per-head norms (qwen3,
# qwen3_moe, exaone4), biases (starcoder2, qwen2), packed q|k|v (gpt_neox), parallel attention and MLP (phi),
# experts (mixtral; qwen3_moe; glm4_moe, whose first layer is dense and whose shared experts are split).
# With ADDED's below, they use every style auto honours (colwise_gather_output and rowwise_split_input:
# phi3, olmo2, olmo3, olmoe, glm4, qwen3_next).
NO_GROUPED_QUERIES = ("gpt_neox",)  # a key/value head per head: --num-query-groups is refused for it
TRAINED = ["qwen3", "mistral", "starcoder2", "gpt_neox", "granite", "llama", "qwen2", "exaone4", "olmo", "phi",
           "nemotron", "smollm3", "mixtral", "qwen3_moe", "glm4_moe"]  # fmt: skip
PIPELINED = ["qwen3", "mistral", "starcoder2", "gpt_neox", "granite", "qwen3_moe"]
# The families issue 27 added, trained in the slow tier (Verify checks each in the default one): Gemma's scaled
# embedding (and Gemma 2's capped logits), Phi-3's packed q|k|v and gate|up (strided), OLMo 2/3's and OLMoE's
# q/k norms over all heads (split, their sums of squares all-reduced), GLM-4's packed gate|up, Apertus'
# learnable activation, GraniteMoE's attention (its plan names only the experts), Qwen3-Next's linear
# attention (its plan's gathered outputs, to the letter; no sequence parallelism: a recurrent state)
ADDED = ["gemma", "gemma2", "gemma3_text", "vaultgemma", "phi3", "olmo2", "olmo3", "glm4", "apertus", "ministral3",
         "granitemoe", "olmoe", "qwen3_next"]  # fmt: skip
# Trained in the slow tier (Verify checks every family in the default one): ADDED, and five of TRAINED whose
# features others of the default tier's stand for (biases: starcoder2; per-head norms: qwen3)
SLOW = [*ADDED, "qwen2", "exaone4", "olmo", "nemotron", "smollm3"]
EXPERTS = {"mixtral": [], "qwen3_moe": ["--moe-ffn-hidden-size", "32"], "glm4_moe": ["--moe-ffn-hidden-size", "32"],
           "granitemoe": ["--ffn-hidden-size", "32"], "olmoe": ["--ffn-hidden-size", "32"],  # experts as wide as the FFN
           # 4 layers: the first full-attention layer is the 4th (HF's cache needs one); the shared expert's width
           "qwen3_next": ["--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32", "--num-layers", "4"]}  # fmt: skip
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
# Shaped by tiny()'s config (--hf-config), which the size flags cannot give: DeepSeek-V3 (multi-head latent
# attention with a query rank, grouped top-k, a dense first layer, shared experts), DeepSeek-V2 (MLA without
# one) and dots1 (per-head norms, shared experts)
CONFIGURED = ["deepseek_v3", "deepseek_v2", "dots1"]
# (layout, world sizes, flags, families); "-kv1": one key/value head, shared by the 2 ranks (multi-query
# attention); at TP4 the 2 key/value heads are each shared by 2 ranks
LAYOUTS = [("tp2", (2,), TP2, [*TRAINED, *CONFIGURED, *ADDED, "llama-kv1", "qwen3_moe-kv1"]),
           ("tp2-sp", (2,), [*TP2, "--sequence-parallel"], ["deepseek_v3", *(f for f in ADDED if f != "qwen3_next")]),
           ("tp2-pp2", (4,), [*TP2, *PP2], [*PIPELINED, "gemma3_text", "phi3"]),
           ("tp4", (4,), ["--tensor-model-parallel-size", "4"], ["llama"])]  # fmt: skip


@pytest.fixture(scope="module")
def configs(shared_tmp):
    """The directory of the CONFIGURED families' --hf-config directories (tiny(family), saved once)."""
    return saved_configs(os.path.join(shared_tmp, "auto-configs"), CONFIGURED)


@pytest.fixture(scope="module")
def reference(shared_tmp, cache, configs):
    """One process's losses per family: those this world size trains, run in one process (the
    default tier's together, the slow tier's SLOW families together; CONFIGURED ones each alone)."""
    here = [family for _, sizes, _, families in LAYOUTS if dist.get_world_size() in sizes for family in families]

    def run(family: str) -> tuple[str, list[str]]:
        return "gpt", [*_trained(family, configs), "--data-cache-path", cache]

    default = reference_losses(shared_tmp, run, [f for f in here if f not in (*CONFIGURED, *SLOW)])
    slow = reference_losses(shared_tmp, run, [f for f in here if f in SLOW])
    return lambda family: (slow if family in SLOW else default)(family)


def _trained(case: str, configs: str) -> list[str]:
    family, _, kv_heads = case.partition("-kv")
    fast = ["--lr", "1e-2", "--min-lr", "1e-3"]  # a clear drop in 10 steps for every family (qwen3_moe was slow)
    if family in CONFIGURED:
        return [*PARITY, *fast, "--hf-config", os.path.join(configs, family), "--schedule", "auto"]
    experts = ["--num-experts", "4", "--moe-router-topk", "2", *EXPERTS[family]] if family in EXPERTS else []
    groups = [] if family in NO_GROUPED_QUERIES else ["--num-query-groups", kv_heads or "2"]
    return [*PARITY, *fast, "--model-type", family, "--schedule", "auto", *groups, *experts]


def _case(family: str, name: str, sizes: tuple, flags: list[str]) -> pytest.param:
    """A parity case; the CONFIGURED and SLOW families' in the slow tier (Verify checks them in the default one)."""
    return layout_case(family, name, sizes, flags, slow=family in (*CONFIGURED, *SLOW))


@pytest.mark.parametrize("family, flags", [_case(f, name, sizes, flags)
                                           for name, sizes, flags, families in LAYOUTS for f in families])  # fmt: skip
def test_auto_trains_as_one_process(family, flags, reference, configs, shared_tmp, cache, request):
    """pretrain_gpt.py --model-type FAMILY (or --hf-config, CONFIGURED) --schedule auto: 10 fp32 steps
    at TP2 (DeepSeek-V3 and the ADDED families with --sequence-parallel too), at TP2 x PP2 (the pipeline
    cut through the traced model) and with key/value heads shared by ranks give one process's losses."""
    tb = os.path.join(shared_tmp, f"tb-auto-{request.node.callspec.id}")
    losses = train_losses("gpt", [*_trained(family, configs), *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, reference(family), 1e-5)


@pytest.mark.parametrize("norm_class", [Olmo2RMSNorm, OlmoeRMSNorm], ids=["cast-last", "cast-first"])
def test_a_split_rms_norm_computes_the_whole_norm_in_bf16(group, rank, norm_class):
    """A q norm over all heads' width split over the ranks (its sum of squares all-reduced) gives this
    rank's part of the whole norm's output, in bf16 too: each family's norm casts back to bf16 where
    it does (OLMo 2 after the weight, OLMoE before it), so the two round alike; and the gradients
    of the input and of this rank's weights are the whole norm's parts."""
    torch.manual_seed(0)
    whole = norm_class(64).to(torch.bfloat16)
    with torch.no_grad():
        whole.weight.normal_()
    split = copy.deepcopy(whole)
    sch = ms.create_schedule(nn.Sequential(split), group)
    SplitRMSNorm(heads=4, cast_first=norm_class is OlmoeRMSNorm).apply(sch["0"])
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    part = slice(rank * 32, (rank + 1) * 32)
    mine = x.detach()[..., part].clone().requires_grad_()
    out, expected = split(mine), whole(x)
    # The sum of squares adds the ranks' halves, the whole norm its 64 squares in the order the CPU's
    # vectorisation takes: an fp32 last bit apart, which can move a rare element across a bf16 rounding
    # boundary. Casting back in the other order than the family's moves a quarter of them.
    moved = (out != expected[..., part]).float().mean().item()
    assert moved < 0.05, moved
    torch.testing.assert_close(out, expected[..., part], rtol=2**-7, atol=1e-6)  # at most one bf16 step apart
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad[..., part])
    torch.testing.assert_close(mine.grad, x.grad[..., part], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(split.weight.grad, whole.weight.grad[part], rtol=1e-2, atol=1e-2)
