"""The time model (estimates/time_model.py) and its hardware profiles: each effect it prices moves the
prediction the way it must, bad profiles are one line, and explain --hardware prints and writes it."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_slapo.arguments.parser import parse_args
from megatron_slapo.errors import ConfigError
from megatron_slapo.estimates import hardware
from megatron_slapo.estimates.op_ledger import Work
from megatron_slapo.estimates.time_model import collective_time, compute_time, interpolated, predict

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--num-workers", "0", "--schedule", "gpt_tp"]  # fmt: skip
H100 = hardware.load("h100-sxm")


def _predict(tmp_path, world, *flags, hw=H100, per_node=8):
    from megatron_slapo.estimates.estimate import estimate

    argv = [*TINY, "--data-cache-path", str(tmp_path / "cache"), *flags]
    args = parse_args("gpt", argv)
    pp = args.pipeline_model_parallel_size
    estimates = [estimate("gpt", argv, world, p * (world // pp), attention="flash") for p in range(pp)]
    return predict(estimates, args, hw, world, per_node)


def test_every_builtin_profile_loads_with_its_sources():
    for name in ("a100-sxm-80g", "h100-sxm", "h200-sxm", "b200"):
        hw = hardware.load(name)
        data = json.loads(Path(hw.source).read_text())
        assert hw.peak("bf16") > 0 and hw.scale_up.gb_per_s > hw.scale_out.gb_per_s
        assert {"peak_tflops", "memory", "scale_up", "scale_out"} <= set(data["sources"])
        assert {"efficiency.gemm_max", "efficiency.link"} <= set(data["fitted"])


def test_a_bad_profile_is_one_line_naming_the_problem(tmp_path):
    with pytest.raises(ConfigError, match=r"no such profile \(built in: a100-sxm-80g, b200, h100-sxm, h200-sxm\)"):
        hardware.load("h100")
    data = json.loads(Path(H100.source).read_text())
    del data["efficiency"]["gemm_max"]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="is missing the field efficiency.gemm_max"):
        hardware.load(str(broken))
    del data["memory_gb_per_s"]
    broken.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="is missing the field memory_gb_per_s"):
        hardware.load(str(broken))
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        hardware.load(str(broken))


def test_compute_prices_gemms_by_their_shape_and_the_rest_by_bytes():
    big, small = Work(gemm={("bf16", 4096, True): [1, 2e12]}), Work(gemm={("bf16", 64, True): [1, 2e12]})
    assert compute_time(small, H100) > 2 * compute_time(big, H100)  # thin GEMMs reach less of the peak
    assert compute_time(Work(gemm={("fp8", 4096, True): [1, 2e12]}), H100) < compute_time(big, H100)
    unaligned = Work(gemm={("bf16", 4096, False): [1, 2e12]})  # a dimension no multiple of 8: slow kernels
    assert compute_time(unaligned, H100) == pytest.approx(1e-6 + (compute_time(big, H100) - 1e-6) / 0.2)
    memory = Work(other_calls=1, other_bytes=10**9, fused_bytes=10**9)
    assert compute_time(memory, H100) == pytest.approx(1e-6 + 1 / 3350)
    assert compute_time(memory, H100, fused=1.0) == pytest.approx(0.2 * compute_time(memory, H100))


def test_a_collective_crossing_nodes_takes_the_slower_link():
    inside = collective_time("all_reduce", 2**30, 1, list(range(8)), H100, 8)
    across = collective_time("all_reduce", 2**30, 1, list(range(0, 64, 8)), H100, 8)
    assert across / inside == pytest.approx(450 / 50, rel=0.01)
    assert inside == pytest.approx(14 * 3e-6 + 2 * 7 / 8 * 2**30 / (450e9 * 0.8))  # ring: 2(n-1) steps and hops
    assert collective_time("irecv", 2**30, 1, [0, 1], H100, 8) == 0  # priced at its send
    measured = replace(H100, collectives={"all_reduce": {"8": [100.0, 1.0]}})
    assert collective_time("all_reduce", 10**9, 2, list(range(8)), measured, 8) == pytest.approx(2e-4 + 1)
    # measured call by call: two calls of 3 MiB each read between the 2 and 4 MiB measurements
    per_call = replace(measured, collective_seconds={"all_reduce": {"8": [[2**21, 1e-3], [2**22, 3e-3]]}})
    assert collective_time("all_reduce", 3 * 2**21, 2, list(range(8)), per_call, 8) == pytest.approx(2 * 2e-3)
    spanning = collective_time("all_reduce", 2**30, 1, list(range(0, 64, 8)), per_call, 8)
    assert spanning == pytest.approx(across), "a calibration measures one machine: across nodes, the link's formula"


def test_measured_times_are_read_between_and_beyond_the_sizes_measured():
    points = [[1.0, 10.0], [3.0, 30.0], [5.0, 40.0]]
    assert [interpolated(points, x) for x in (2.0, 4.0, 7.0, 0.0, 0.5)] == [20.0, 35.0, 56.0, 10.0, 10.0]
    assert interpolated([[1.0, 2.0]], 9.0) == 18.0


def test_tensor_parallelism_across_nodes_is_predicted_slower(tmp_path):
    near = _predict(tmp_path, 2, "--tensor-model-parallel-size", "2")
    far = _predict(tmp_path, 2, "--tensor-model-parallel-size", "2", per_node=1)
    assert far.breakdown_s["communication[tp]"] > 1.5 * near.breakdown_s["communication[tp]"]  # latency-bound: tiny
    assert far.step_time_s > near.step_time_s
    assert near.tokens_per_s_per_device == pytest.approx(8 * 64 / near.step_time_s / 2)


def test_overlap_hides_data_parallel_gradients_only_where_the_engine_overlaps(tmp_path):
    hidden = _predict(tmp_path, 2, "--engine", "ddp")
    exposed = _predict(tmp_path, 2, "--engine", "ddp", hw=replace(H100, communication_overlap=0.0))
    assert "communication[dp-cp]" not in hidden.breakdown_s or (
        hidden.breakdown_s["communication[dp-cp]"] < exposed.breakdown_s["communication[dp-cp]"])  # fmt: skip
    megatron = _predict(tmp_path, 2)  # megatron-core's DDP without --overlap-grad-reduce: after the backward
    overlapped = _predict(tmp_path, 2, "--overlap-grad-reduce")
    assert overlapped.breakdown_s.get("communication[dp-cp]", 0) < megatron.breakdown_s["communication[dp-cp]"]


def test_the_pipeline_bubble_and_recompute_are_priced(tmp_path):
    pp = _predict(tmp_path, 2, "--pipeline-model-parallel-size", "2")
    assert pp.breakdown_s["bubble"] > 0 and pp.slowest_rank in (0, 1)
    plain = _predict(tmp_path, 1)
    full = _predict(tmp_path, 1, "--recompute-granularity", "full", "--recompute-method", "uniform")
    assert "recompute" not in plain.breakdown_s and full.breakdown_s["recompute"] > 0
    assert full.mfu < plain.mfu and full.tflops_per_device < plain.tflops_per_device  # Megatron's model FLOPs


def _explain(tmp_path, *flags):
    cmd = [sys.executable, "tools/explain.py", *TINY, *flags, "--data-cache-path", str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_explain_predicts_the_step_and_writes_it(tmp_path):
    out = tmp_path / "plan.json"
    done = _explain(tmp_path, "--hardware", "h100-sxm", "--nodes", "2", "--gpus-per-node", "2",
                    "--tensor-model-parallel-size", "2", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Predicted on h100-sxm (2 node(s) x 2), slowest rank 0: step " in done.stdout
    assert "where the time goes: " in done.stdout
    predicted = json.loads(out.read_text())["predicted"]
    assert {"step_time_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "breakdown_s"} <= set(predicted)
    assert predicted["breakdown_s"]["compute"] > 0 and 0 < predicted["mfu"] < 1


@pytest.mark.parametrize(
    "flags, message",
    [(["--hardware", "tpu-v5"], "--hardware tpu-v5: no such profile"),
     (["--gpus-per-node", "4"], "--gpus-per-node and --nodes place a run on hardware: give --hardware too"),
     (["--hardware", "h100-sxm", "--nodes", "2", "--gpus-per-node", "4", "--world-size", "4"],
      "--world-size 4 is not --nodes 2 x --gpus-per-node 4")],
)  # fmt: skip
def test_explain_refuses_bad_hardware_flags_in_one_line(tmp_path, flags, message):
    done = _explain(tmp_path, *flags)
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and err == [f"explain.py: error: {message}" + err[0].split(message, 1)[1]], err


def test_explain_says_which_rank_does_not_fit_and_by_how_much(tmp_path):
    small = json.loads(Path(H100.source).read_text()) | {"memory_gib": 0.001}
    profile = tmp_path / "small.json"
    profile.write_text(json.dumps(small))
    done = _explain(tmp_path, "--hardware", str(profile))
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(err) == 1, err
    assert err[0].startswith("explain.py: error: the layout does not fit in memory: rank 0 needs ")
    assert "GiB at its peak, more than the 0.001 GiB of a h100-sxm device" in err[0]
