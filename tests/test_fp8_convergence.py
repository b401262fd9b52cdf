"""FP8 learns like bf16: the quick-start model trained 300 iterations with ``--fp8-format hybrid``
ends within 2% of the bf16 run's validation loss (``tools/fp8_convergence.py``, which drew the
curves in docs/benchmarks/; FP8 emulated here: the same casts and scales a GPU applies)."""

import json

import pytest

from tools import fp8_convergence


@pytest.mark.slow
def test_fp8_ends_within_two_percent_of_bf16s_validation_loss(tmp_path):
    fp8_convergence.main(["--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    last = summary["last_validation"]
    assert set(last) == {"bf16", "fp8-hybrid"}
    assert all(max(map(int, v)) == 300 for v in summary["validation"].values())  # validated at the last iteration
    assert abs(last["fp8-hybrid"] / last["bf16"] - 1) < 0.02, last
    first = {name: v[min(v, key=int)] for name, v in summary["validation"].items()}
    assert all(last[name] < first[name] - 0.5 for name in last), (first, last)  # both learned
    assert (tmp_path / "training-loss.png").stat().st_size and (tmp_path / "validation-loss.png").stat().st_size
