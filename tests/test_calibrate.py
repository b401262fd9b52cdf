"""tools/calibrate.py as a user runs it: a quick calibration of this machine that
``hardware.load`` accepts, with sane (positive) numbers; and the fits it makes, on made-up times."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.errors import ConfigError
from megatron_slapo.estimates import calibration, hardware

ROOT = Path(__file__).resolve().parents[1]


def _calibrate(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "tools/calibrate.py", *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibration") / "calibration.json"
    done = _calibrate("--quick", "--ranks", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all_reduce" in done.stdout and "peak TFLOP/s" in done.stdout
    return out


def test_quick_calibration_is_a_profile(profile_path: Path) -> None:
    hw = hardware.load(str(profile_path))
    assert hw.peak("fp32") > 0 and hw.peak("bf16") > 0
    assert hw.memory_gb_per_s > 0 and hw.memory_gib > 0 and hw.op_overhead_us > 0
    assert hw.efficiency["gemm_max"] > 0 and hw.efficiency["gemm_half_dim"] >= 0 and hw.efficiency["attention"] > 0
    assert hw.scale_up.gb_per_s > 0 and hw.scale_up.latency_us >= 0 and 0 <= hw.communication_overlap <= 1
    assert hw.attention_kernel in ("flash", "eager")
    assert set(hw.collectives) == set(calibration.COLLECTIVES)
    for fits in hw.collectives.values():
        latency, gb_per_s = fits["2"]
        assert latency >= 0 and gb_per_s > 0
    assert set(hw.collective_seconds) == set(calibration.COLLECTIVES)
    for points in hw.collective_seconds.values():
        sizes, seconds = zip(*points["2"], strict=True)
        assert list(sizes) == sorted(sizes) and list(seconds) == sorted(seconds) and seconds[0] > 0
    data = json.loads(profile_path.read_text())
    assert data["cache_gb_per_s"] > 0 and data["op_overhead_nograd_us"] > 0
    assert data["measurements"]["collectives"]["2"]["all_reduce"], "the raw times are kept"


def test_a_profile_missing_a_field_is_refused_in_one_line(profile_path: Path, tmp_path: Path) -> None:
    data = json.loads(profile_path.read_text())
    del data["efficiency"]["gemm_half_dim"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="missing the field efficiency.gemm_half_dim") as refused:
        hardware.load(str(edited))
    assert "\n" not in str(refused.value)


def test_an_unwritable_out_is_refused_before_measuring(tmp_path: Path) -> None:
    done = _calibrate("--quick", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"calibrate.py: error: --out {tmp_path} is a directory, but --out "
                                                "needs a file: give a file path"]  # fmt: skip


def test_fits_recover_the_parameters_of_made_up_times() -> None:
    overhead, peak, gemm_max, half = 2e-6, 1e12, 0.8, 64.0
    shapes = [(d, 4 * d, 2 * d) for d in (16, 32, 64, 128, 256, 512, 1024)]
    samples = [(2 * m * n * k / peak, m, overhead + 2 * m * n * k / (peak * gemm_max * m / (m + half)), "fp32")
               for m, n, k in shapes]  # fmt: skip
    fitted_max, fitted_half, error = calibration.fit_gemm(samples, overhead)
    assert fitted_max == pytest.approx(gemm_max, rel=0.01) and fitted_half == pytest.approx(half, rel=0.01)
    assert error < 0.01
    latency_us, gb_per_s = calibration.fit_link([(n, 50e-6 + n / 2e9) for n in (2**10, 2**16, 2**20, 2**25)])
    assert latency_us == pytest.approx(50, rel=1e-6) and gb_per_s == pytest.approx(2, rel=1e-6)
    latency_us, gb_per_s = calibration.fit_link([(2**10, 2e-3), (2**16, 1.8e-3), (2**20, 1.5e-3)])  # noise: no growth
    assert latency_us > 0 and gb_per_s == pytest.approx(2**20 / 1.5e-3 / 1e9)
    assert calibration.fit_efficiency([(f, f / (peak * 0.4)) for f in (1e9, 1e10)], peak) == pytest.approx(0.4)
    # a larger call takes no less time: what says otherwise is pooled (least squares)
    assert calibration.monotone([[1, 3.0], [2, 1.0], [4, 5.0], [8, 4.0], [16, 9.0]]) == [
        [1, 2.0], [2, 2.0], [4, 4.5], [8, 4.5], [16, 9.0]]  # fmt: skip
