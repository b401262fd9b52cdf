"""tools/plot.py: TensorBoard's smoothing, labels by what ran, runs found under a directory of runs."""

import math
import random

import pytest

from tools.plot import find_runs, labels, main, read_scalars, smooth


def _debiased_average(values: list[float], weight: float) -> list[float]:
    """The same smoothing written another way: after n points, the average of the points so far
    weighted by ``weight ** age`` (its newest point has age 0)."""
    out = []
    for n in range(1, len(values) + 1):
        ages = [weight ** (n - 1 - i) for i in range(n)]
        out.append(sum(a * v for a, v in zip(ages, values[:n], strict=True)) / sum(ages))
    return out


def test_smoothing_is_tensorboards_debiased_moving_average():
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 5 / 3, 17 / 7])  # by hand
    values = [random.Random(0).uniform(-5, 5) for _ in range(50)]
    for weight in (0.0, 0.3, 0.6, 0.99):
        assert smooth(values, weight) == pytest.approx(_debiased_average(values, weight))
    assert smooth(values, 0.0) == values
    assert smooth([4.0] * 10, 0.9) == pytest.approx([4.0] * 10)  # no pull towards zero at the start
    nan_kept = smooth([1.0, math.nan, 3.0], 0.5)  # a non-finite point is drawn as it is, left out of the average
    assert nan_kept[0] == 1.0 and math.isnan(nan_kept[1]) and nan_kept[2] == pytest.approx(7 / 3)


def test_labels_name_what_ran_and_add_the_time_only_where_needed():
    gpt = "runs/gpt-gpt2-4x256-tp2pp1dp1-gpt_tp"
    assert labels([f"{gpt}/20261126-150000", "runs/bert-bert-4x256-tp1pp1dp2-default/20261126-150000/"]) == [
        "gpt-gpt2-4x256-tp2pp1dp1-gpt_tp",
        "bert-bert-4x256-tp1pp1dp2-default",
    ]
    assert labels([f"{gpt}/20261126-150000", f"{gpt}/20261126-160000", "runs/mine"]) == [
        "gpt-gpt2-4x256-tp2pp1dp1-gpt_tp/20261126-150000",
        "gpt-gpt2-4x256-tp2pp1dp1-gpt_tp/20261126-160000",
        "mine",
    ]
    assert labels(["a/tb", "b/tb", "c/other"]) == ["a/tb", "b/tb", "other"]  # --tensorboard-dir's own names


def _write(directory, values):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(directory)) as writer:
        for step, value in enumerate(values, 1):
            writer.add_scalar("lm loss", value, step)


def test_a_directory_of_runs_is_drawn_smoothed_with_its_raw_points_faint(tmp_path, capsys):
    runs = tmp_path / "runs"
    noisy = [8.0 - 0.1 * step + (0.5 if step % 2 else -0.5) for step in range(20)]
    _write(runs / "gpt-gpt2-2x64-tp2pp1dp1-gpt_tp" / "20261126-150000", noisy)
    _write(runs / "t5-t5-2x64-tp1pp1dp2-default" / "20261126-150500", [9.0] * 20)
    found = find_runs([str(runs)])
    assert [p.split("/")[-2] for p in found] == ["gpt-gpt2-2x64-tp2pp1dp1-gpt_tp", "t5-t5-2x64-tp1pp1dp2-default"]
    assert read_scalars(found[0])["lm loss"] == pytest.approx(dict(enumerate(noisy, 1)))
    png = tmp_path / "curves.png"
    main([str(runs), "--smooth", "0.8", "--out", str(png)])
    assert capsys.readouterr().out.strip() == f"{png}: lm loss for 2 run(s)"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tools.plot import plot

    fig = plot({"gpt": read_scalars(found[0])}, ["lm loss"], str(png), smoothing=0.8)
    (ax,) = fig.axes
    raw, smoothed = ax.get_lines()
    assert raw.get_alpha() < 1 and list(raw.get_ydata()) == pytest.approx(noisy)
    assert list(smoothed.get_ydata()) == pytest.approx(smooth(noisy, 0.8)) and smoothed.get_label() == "gpt"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gpt"]


@pytest.mark.parametrize("weight", ["1", "-0.1"])
def test_a_smoothing_weight_out_of_range_is_one_line(tmp_path, capsys, weight):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path), "--smooth", weight, "--out", str(tmp_path / "x.png")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"plot.py: error: --smooth {float(weight):g}: give a weight from 0 (no smoothing) to below 1"
    )


def test_a_run_that_logged_nothing_yet_is_left_out_with_a_note(tmp_path, capsys):
    """A run stopped before its first logged iteration holds an event file but no scalars."""
    from torch.utils.tensorboard import SummaryWriter

    runs = tmp_path / "runs"
    _write(runs / "gpt-gpt2-2x64-tp2pp1dp1-gpt_tp" / "20261126-150000", [8.0, 7.5, 7.0])
    SummaryWriter(str(runs / "gpt-gpt2-2x64-tp1pp1dp2-default" / "20261126-151000")).close()
    png = tmp_path / "curves.png"
    main([str(runs), "--out", str(png)])
    captured = capsys.readouterr()
    assert captured.out.strip() == f"{png}: lm loss for 1 run(s)"
    assert (
        captured.err.strip()
        == f"plot.py: left out (no scalars yet): {runs}/gpt-gpt2-2x64-tp1pp1dp2-default/20261126-151000"
    )
    with pytest.raises(SystemExit, match="no TensorBoard scalars to plot"):
        main([str(runs / "gpt-gpt2-2x64-tp1pp1dp2-default"), "--out", str(png)])
