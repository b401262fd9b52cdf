"""--expert-model-parallel-size: whole routed experts on ranks, tokens moved by all-to-all. Trained
10 fp32 steps against one process at every layout it composes with (the README's suite: qwen3_moe
at EP2 with the all-to-all dispatcher; the slow tier: the rest); the all-to-all bytes against the
analytic count; an expert-parallel checkpoint resumed and exported to HF."""

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_slapo.parallel.comm_log import CommLog
from megatron_slapo.training.loop import pretrain
from tests.distributed.families import saved_configs
from tests.distributed.runs import (
    PARITY,
    asked,
    assert_grad_norm_parity,
    assert_parity,
    last_rank_value,
    layout_case,
    reference_losses,
    refused_on_every_rank,
    single_process_losses,
    train_losses,
)
from tests.utils import tb_scalars
from tools.convert_checkpoint import main as convert

FAMILIES = {"qwen3_moe": ["--moe-ffn-hidden-size", "32"], "mixtral": [], "qwen2_moe": [], "ernie4_5_moe": [],
            "glm4_moe": [], "minimax": []}  # fmt: skip
EP2, TP2, PP2 = (["--expert-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"],
                 ["--pipeline-model-parallel-size", "2"])  # fmt: skip
SP = ["--sequence-parallel"]
MBS2 = ["--micro-batch-size", "2"]  # 4 data-parallel ranks share the global batch of 8
TOPK, HIDDEN = 2, 64
# (family, layout, world sizes, flags): the slow tier, but for DEFAULT
LAYOUTS = [
    ("qwen3_moe", "ep2", (2,), EP2),
    ("qwen3_moe", "ep2-allgather-distopt", (2,), [*EP2, "--moe-token-dispatcher-type", "allgather",
                                                   "--use-distributed-optimizer"]),
    ("qwen3_moe", "ep2-ddp", (2,), [*EP2, "--engine", "ddp"]),
    *((family, "ep2", (2,), EP2) for family in ("mixtral", "qwen2_moe", "ernie4_5_moe", "glm4_moe", "minimax")),
    ("qwen3_moe", "ep2-tp2-sp", (4,), [*EP2, *TP2, *SP]),  # each expert split by features too (ETP = TP)
    ("qwen3_moe", "ep2-tp2-sp-etp1", (4,), [*EP2, *TP2, *SP, "--expert-tensor-parallel-size", "1"]),
    ("qwen3_moe", "ep2-pp2", (4,), [*EP2, *PP2]),
    # 4 data-parallel ranks, 2 copies of each expert: their gradients reduced over the expert-data-parallel group
    ("qwen3_moe", "ep2-dp4-distopt", (4,), [*EP2, *MBS2, "--use-distributed-optimizer"]),
    ("qwen3_moe", "ep2-dp4-ddp", (4,), [*EP2, *MBS2, "--engine", "ddp"]),
    ("deepseek_v3", "ep2", (2,), EP2),  # MLA, grouped top-k, shared experts, a dense first layer
    ("dots1", "ep2", (2,), EP2),
    ("qwen3_moe-capacity", "ep2", (2,), EP2),  # tokens over capacity dropped, the same as on one device
    ("qwen3_moe-aux", "ep2", (2,), EP2),  # with the model's load-balancing loss
]  # fmt: skip
# The README's suite's cross-rank check: rows routed to the other rank's experts and back (a row sent
# to the wrong rank, or back to the wrong place, moves the losses)
DEFAULT = {"qwen3_moe-ep2"}
VARIANTS = {"capacity": ["--moe-expert-capacity-factor", "1.0"], "aux": ["--moe-aux-loss-coeff", "0.1"]}
CONFIGURED = ("deepseek_v3", "dots1")  # built from families.py's tiny configs (--hf-config)


def _trained(case: str, configs: str = "") -> list[str]:
    family, _, variant = case.partition("-")
    fast = [*PARITY, "--lr", "1e-2", "--min-lr", "1e-3", "--schedule", "auto", *VARIANTS.get(variant, [])]
    if family in CONFIGURED:
        return [*fast, "--hf-config", os.path.join(configs, family)]
    experts = ["--num-experts", "4", "--moe-router-topk", str(TOPK), *FAMILIES[family]]
    return [*fast, "--model-type", family, "--num-query-groups", "2", *experts]


@pytest.fixture(scope="module")
def configs(shared_tmp):
    return saved_configs(os.path.join(shared_tmp, "ep-configs"), list(CONFIGURED))


@pytest.fixture(scope="module")
def reference(shared_tmp, cache, configs, request):
    """One process's runs of the families this session trains, run in one process."""
    here = asked(request, "family")

    def run(family: str) -> tuple[str, list[str]]:
        return "gpt", [*_trained(family, configs), "--data-cache-path", cache]

    return reference_losses(shared_tmp, run, here)


def _case(family: str, name: str, sizes: tuple, flags: list[str]) -> pytest.param:
    return layout_case(family, name, sizes, flags, slow=f"{family}-{name}" not in DEFAULT)


@pytest.mark.parametrize("family, flags", [_case(*layout) for layout in LAYOUTS])
def test_expert_parallel_trains_as_one_process(family, flags, reference, configs, shared_tmp, cache, request):
    """Each step's loss within 1e-5 of one process's, and its gradient norm within 1e-4 (relative;
    fp32 reduction order moves it by ~3e-5): the routed rows' exchanges, the experts' gradients
    reduced over the expert-data-parallel ranks only."""
    tb = os.path.join(shared_tmp, f"tb-ep-{request.node.callspec.id}")
    losses = train_losses("gpt", [*_trained(family, configs), *flags, "--data-cache-path", cache], tb)
    assert_parity(losses, reference(family), 1e-5)
    assert_grad_norm_parity(tb, reference(family, "grad-norm"), 1e-4)
    if family.endswith("-capacity"):  # the log reports the pairs dropped: some, not all
        dropped = last_rank_value(lambda: tb_scalars(tb, "moe dropped tokens (fraction)"))
        assert sorted(dropped) == list(range(1, 11)) and 0 < min(dropped.values()) <= max(dropped.values()) < 1


@pytest.mark.parametrize("argv, message", [
    (["--model-type", "qwen3_moe", "--num-experts", "3", "--moe-ffn-hidden-size", "32", *EP2],
     "3 experts do not split over 2 expert-parallel ranks"),
    (["--model-type", "llama", *EP2], "publishes no base_model_ep_plan naming its experts"),
    (["--model-type", "qwen3_moe", "--num-experts", "4", "--moe-ffn-hidden-size", "32", *EP2, "--schedule", "default"],
     "--schedule default placed no experts on the expert-parallel ranks"),
    (["--model-type", "llama", "--schedule", "auto", "--moe-expert-capacity-factor", "1"],
     "--moe-expert-capacity-factor: --schedule auto placed no experts to limit"),
])  # fmt: skip
def test_expert_parallelism_it_cannot_place_is_one_error_before_compute(argv, message, shared_tmp, cache, capsys):
    tb = os.path.join(shared_tmp, "tb-ep-refused")
    line = refused_on_every_rank([*PARITY, "--train-iters", "1", "--data-cache-path", cache, "--tensorboard-dir", tb,
                                  *argv], capsys)  # fmt: skip
    assert message in line, line


def test_all_to_all_bytes_per_step_equal_the_analytic_count(shared_tmp, cache, monkeypatch):
    """Per MoE layer and micro-batch, each of the tokens x top-k routed rows (hidden x 4 bytes) crosses
    four times: to its expert's rank and back, forward and backward. A rank's share depends on the
    routing (the rows it receives), so the count is summed over the expert-parallel ranks; the
    routing counts themselves go by all-gather, not by all-to-all."""
    counts = []
    take = CommLog.take
    monkeypatch.setattr(CommLog, "take", lambda self: counts.append(take(self)) or counts[-1])
    tb = os.path.join(shared_tmp, "tb-ep-comm")
    pretrain("gpt", [*_trained("qwen3_moe"), "--train-iters", "3", *EP2, "--log-comm", "--data-cache-path", cache,
                     "--tensorboard-dir", tb])  # fmt: skip
    steps = counts[1::2]  # the loop takes the counts before each step (and drops them), then after it
    mine = [step.get("all_to_all[ep]", 0) for step in steps]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tokens = 4 * 32  # TINY: 8 sequences of 32 a step, 4 on each of the 2 data-parallel ranks
    layers = 2
    expected = dist.get_world_size() * layers * 4 * tokens * TOPK * HIDDEN * 4
    assert len(mine) == 3 and [sum(step) for step in zip(*everyone, strict=True)] == [expected] * 3, (
        everyone,
        expected,
    )
    assert all("all_gather_single[ep]" in step for step in steps)  # the routing counts


@pytest.mark.slow
@pytest.mark.parametrize("flags", [pytest.param(EP2, id="ep2", marks=pytest.mark.world_sizes(2)),
                                   pytest.param([*EP2, *TP2, *SP], id="ep2-tp2-sp", marks=pytest.mark.world_sizes(4))])  # fmt: skip
def test_an_expert_parallel_checkpoint_resumes_and_exports_the_experts_in_hfs_layout(flags, reference, shared_tmp,
                                                                                      cache, rank, request):  # fmt: skip
    """An EP2 run (each expert whole, or also split by its features over TP2) saved at step 5
    resumes, at its layout and in one process (each rank saved its own experts, under their global
    place), to the uninterrupted run's losses; tools/convert_checkpoint.py to-hf writes every expert
    in HF's layout and transformers loads exactly the saved tensors."""
    case = request.node.callspec.id
    root = os.path.join(shared_tmp, f"ckpt-{case}")
    argv = [*_trained("qwen3_moe"), "--data-cache-path", cache]
    first = train_losses("gpt", [*argv, *flags, "--save", root, "--save-interval", "5", "--exit-interval", "5"],
                         os.path.join(shared_tmp, f"tb-save-{case}"))  # fmt: skip
    resumed = train_losses("gpt", [*argv, *flags, "--load", root], os.path.join(shared_tmp, f"tb-resume-{case}"))
    alone = single_process_losses("gpt", [*argv, "--load", root], os.path.join(shared_tmp, f"tb-alone-{case}"))
    hf, saved = os.path.join(shared_tmp, f"hf-{case}"), os.path.join(shared_tmp, f"saved-{case}.pt")
    if rank == 0:
        convert(["to-hf", "--load", root, "--iteration", "5", "--save-hf", hf])
        dcp_to_torch_save(os.path.join(root, "iter_0000005"), saved)
    dist.barrier()
    assert_parity({**first, **resumed}, reference("qwen3_moe"), 1e-5)
    assert sorted(alone) == list(range(6, 11)) and max(abs(alone[i] - resumed[i]) for i in alone) < 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 2 * 32, HIDDEN) and experts.down_proj.shape == (4, HIDDEN, 32)
    tensors = torch.load(saved, weights_only=False)
    for name, value in model.state_dict().items():  # the vocabulary's padding rows (saved: they train) left out
        assert torch.equal(value, tensors[f"model.{name}"][tuple(slice(0, n) for n in value.shape)]), name
