"""The auto-tuner: its space, its search (explain prunes, trials run, results resume) and the command."""

import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_slapo.errors import ConfigError
from megatron_slapo.tuning.search import Cost, ring_traffic, search
from megatron_slapo.tuning.space import Space
from tests.utils import tb_scalars

ROOT = Path(__file__).resolve().parents[1]


def test_candidates_follow_earlier_choices_and_constraints_remove_points():
    space = Space()
    space.symbol("tp", [1, 2, 4])
    space.symbol("sp", lambda p: [False, True] if p["tp"] > 1 else [False])
    space.symbol("mbs", [1, 2])
    space.constraint(lambda p: p["tp"] * p["mbs"] <= 4, "at most 4 per rank")
    points = list(space)
    assert points == [
        {"tp": 1, "sp": False, "mbs": 1}, {"tp": 1, "sp": False, "mbs": 2},
        {"tp": 2, "sp": False, "mbs": 1}, {"tp": 2, "sp": False, "mbs": 2},
        {"tp": 2, "sp": True, "mbs": 1}, {"tp": 2, "sp": True, "mbs": 2},
        {"tp": 4, "sp": False, "mbs": 1}, {"tp": 4, "sp": True, "mbs": 1},
    ]  # fmt: skip
    assert len(space) == 8 and space.names == ["tp", "sp", "mbs"]
    assert space.rejected({"tp": 4, "sp": True, "mbs": 2}) == "at most 4 per rank"
    with pytest.raises(ValueError, match="declared twice"):
        space.symbol("tp", [1])


def _toy():
    """A space whose costs are known: recompute adds FLOPs and saves memory, ZeRO adds traffic and
    saves memory, TP halves both; a step's time grows with FLOPs and traffic, shrinks with mbs."""
    space = Space().symbol("tp", [1, 2]).symbol("mbs", [1, 2]).symbol("zero", [0, 1]).symbol("recompute", [0, 1])

    def plan(flags):
        p = json.loads(flags[0])
        if p["tp"] == 2 and p["mbs"] == 1 and p["zero"] == 1 and p["recompute"] == 1:
            raise ValueError("the trainer refuses this one")
        flops = 100 / p["tp"] * (1.3 if p["recompute"] else 1.0)
        traffic = 50 * (1 + p["zero"]) + 20 * (p["tp"] - 1)
        memory = 1000 * p["mbs"] / p["tp"] / (2 if p["recompute"] else 1) / (1.5 if p["zero"] else 1)
        return Cost(int(memory), flops, traffic)

    def time_of(flags):
        try:
            q = plan(flags)
        except ValueError as e:  # the trainer would refuse it too
            return {"error": str(e)}
        return {"step_seconds": (q.flops + q.traffic) / (1 + 0.2 * json.loads(flags[0])["mbs"])}

    return space, plan, time_of


def test_the_search_runs_fewer_trials_and_finds_the_exhaustive_best(tmp_path):
    space, plan, time_of = _toy()
    runs = []

    def run(flags):
        runs.append(flags)
        return time_of(flags)

    flags_of = lambda p: [json.dumps(p)]  # noqa: E731
    budget = 700  # tp 1 at mbs 2 fits only with recompute or ZeRO
    out = io.StringIO()
    savers = ("recompute", "zero")
    tuned = search(space, flags_of, plan, run, budget, savers=savers, results=str(tmp_path / "r.jsonl"), stream=out)
    exhaustive = search(space, flags_of, plan, time_of, budget, exhaustive=True,
                        stream=io.StringIO())  # fmt: skip
    best_fitting = min((c for c in exhaustive.candidates if _fits(plan, c.flags, budget)), key=lambda c: c.seconds)
    assert tuned.best.point == best_fitting.point
    assert tuned.ran == len(runs) < len(exhaustive.candidates) == 16
    over = [c for c in tuned.candidates if c.reason == "over the memory budget"]
    assert over and all(c.flags not in runs for c in over)  # never run
    dominated = [c for c in tuned.candidates if c.reason == "dominated"]
    assert dominated and all(c.flags not in runs for c in dominated)
    refused = [c for c in tuned.candidates if c.reason == "refused"]
    assert [c.point for c in refused] == [{"tp": 2, "mbs": 1, "zero": 1, "recompute": 1}]
    assert refused[0].why == "the trainer refuses this one"
    assert tuned.counts == {"over the memory budget": len(over), "dominated": len(dominated), "refused": 1}
    lines = out.getvalue().splitlines()
    assert len(lines) == tuned.ran and lines[-1].startswith(f"[{'#' * 20}] {tuned.ran}/{tuned.ran} trials, 0 left")
    assert "best" in lines[0] and "1 left" in lines[-2]
    # Resumed from its results file: nothing runs again, the same best
    again = search(space, flags_of, plan, lambda f: pytest.fail("re-ran a trial"), budget, savers=savers,
                   results=str(tmp_path / "r.jsonl"), stream=io.StringIO())  # fmt: skip
    assert (again.ran, again.resumed, again.best.point) == (0, tuned.ran, tuned.best.point)
    # ... but not results measured under another setting (other fixed flags, ranks or steps)
    other = search(space, flags_of, plan, run, budget, savers=savers, results=str(tmp_path / "r.jsonl"),
                   setting={"nproc": 8}, stream=io.StringIO())  # fmt: skip
    assert (other.ran, other.resumed) == (tuned.ran, 0)


def test_a_resumed_search_reuses_its_plans_unless_the_setting_or_the_planner_changed(tmp_path):
    space, plan, time_of = _toy()
    planned = []

    def counting(flags):
        planned.append(flags)
        return plan(flags)

    def tune(**kw):
        planned.clear()
        return search(space, lambda p: [json.dumps(p)], counting, time_of, 700, savers=("recompute", "zero"),
                      results=str(tmp_path / "r.jsonl"), stream=io.StringIO(), **kw)  # fmt: skip

    first = tune(plan_version="a")
    assert len(planned) == 16 and first.plans_kept == 0
    again = tune(plan_version="a")
    assert planned == [] and again.plans_kept == 16 and again.ran == 0
    assert [(c.reason, c.why, c.cost) for c in again.candidates] == [
        (c.reason, c.why, c.cost) for c in first.candidates
    ]
    assert again.best.point == first.best.point and again.ignored == 0  # plan lines are not results
    assert len(tune(plan_version="b").candidates) == len(planned) == 16  # the planner's code changed
    assert tune(plan_version="a", setting={"flags": ["--seq-length", "64"]}).plans_kept == 0  # other fixed flags


def test_a_point_runs_after_all_when_the_point_that_dominated_it_fails():
    space = Space().symbol("recompute", ["none", "selective", "full"])
    costs = {"none": Cost(1, 1.0, 1.0), "selective": Cost(1, 1.5, 1.0), "full": Cost(1, 2.0, 1.0)}
    results = {"none": {"error": "exit status 1: torch.OutOfMemoryError: CUDA out of memory"},
               "selective": {"step_seconds": 1.5}, "full": {"step_seconds": 2.0}}  # fmt: skip
    calls = []

    def run(flags):
        calls.append(flags[0])
        return results[flags[0]]

    out = search(space, lambda p: [p["recompute"]], lambda f: costs[f[0]], run, 10, stream=io.StringIO())
    # "none" failed: "selective" is no longer beaten and runs; "full" is still beaten by "selective"
    assert calls == ["none", "selective"] and out.best.point == {"recompute": "selective"}
    assert out.counts == {"dominated": 1} and out.ran == 2
    assert [c.why for c in out.candidates] == ["", "", "by recompute=selective"]


def test_a_point_explain_cannot_plan_is_not_run_and_says_why():
    def plan(flags):
        if flags[0] == "2":
            raise KeyError("wte")
        return Cost(1, 1.0, 1.0)

    space = Space().symbol("x", [1, 2])
    out = search(space, lambda p: [str(p["x"])], plan, lambda f: {"step_seconds": 1.0}, 10, stream=io.StringIO())
    assert out.counts == {"not explained": 1} and [c.why for c in out.candidates] == ["", "KeyError: 'wte'"]


def test_confirmation_rounds_let_the_median_decide_between_near_ties(tmp_path):
    space = Space().symbol("x", ["a", "b", "c"])
    cost = {"a": Cost(1, 1.0, 1.0), "b": Cost(1, 1.0, 2.0), "c": Cost(1, 2.0, 1.0)}
    # "a" wins its trial by luck (1.00 against 1.05); its later runs say 1.20. "c" is far behind.
    times = {"a": [1.0, 1.2, 1.2], "b": [1.05, 1.06, 1.04], "c": [3.0]}
    calls = []

    def run(flags):
        calls.append(flags[0])
        return {"step_seconds": times[flags[0]][calls.count(flags[0]) - 1]}

    out = io.StringIO()
    result = search(space, lambda p: [p["x"]], lambda f: cost[f[0]], run, 10, savers=(), confirm=2,
                    results=str(tmp_path / "r.jsonl"), stream=out)  # fmt: skip
    assert result.best.point == {"x": "b"} and result.best.seconds == 1.05
    assert calls == ["a", "b", "c", "a", "b", "a", "b"]  # trials, then two rounds of the two within 10%
    assert "confirming, round 2/2: x=b: median 1050.0 ms over 3 runs" in out.getvalue()
    again = search(space, lambda p: [p["x"]], lambda f: cost[f[0]], lambda f: pytest.fail("re-ran"), 10, savers=(),
                   confirm=2, results=str(tmp_path / "r.jsonl"), stream=io.StringIO())  # fmt: skip
    assert again.best.point == {"x": "b"}


def _fits(plan, flags, budget):
    try:
        return plan(flags).peak <= budget
    except ValueError:
        return False


def test_ring_traffic_counts_an_all_reduce_twice_and_a_receive_not_at_all():
    comm = {"all_reduce[dp]": 10, "reduce_scatter_single[dp]": 10, "all_gather_single[dp]": 10, "irecv[pp]": 5}
    assert ring_traffic(comm) == 40  # a receive sends nothing


def _tune(tmp_path, *extra):
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "tools/autotune.py", "--nproc-per-node", "2", "--pp", "1", "--sp", "off", "--zero", "0",
           "--micro-batch-sizes", "4", "--recompute", "none,full", "--warmup", "1", "--steps", "1", "--confirm-rounds", "0",
           "--results", str(results), *extra, "--", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "8", "--num-workers", "0",
           "--train-iters", "2", "--eval-iters", "0", "--data-cache-path", str(tmp_path / "cache"),
           "--tensorboard-dir", str(tmp_path / "tb")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900), results


@pytest.mark.slow
def test_autotune_runs_trials_resumes_and_prints_a_command_that_trains(tmp_path):
    from tools.autotune import launcher

    done, results = _tune(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    # tp 1 (default) or 2 (gpt_tp, no --schedule given), each with and without recompute: recompute
    # is dominated where the layer fits
    assert "> searching 4 configurations on 2 ranks" in lines[0]
    assert "> explained 4 configurations: 4 now, 0 kept in" in done.stdout
    summary = next(line for line in lines if line.startswith("> 2 trials of 4"))
    assert "2 run now" in summary and "2 dominated" in summary and "all 4" in summary
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    trials = [r for r in rows if "result" in r]
    assert len(trials) == 2 and all(r["result"]["step_seconds"] > 0 for r in trials)
    assert {r["point"]["recompute"] for r in trials} == {"none"} and {r["point"]["tp"] for r in trials} == {1, 2}
    assert len([r for r in rows if "plan" in r]) == 4 and "refused" not in done.stdout
    command = lines[-1]
    prefix = [*launcher(), "--standalone", "--nproc_per_node=2", "pretrain_gpt.py"]
    assert shlex.split(command)[: len(prefix)] == prefix
    again, _ = _tune(tmp_path)  # resumed: nothing explained or run again
    assert again.returncode == 0 and "0 run now, 2 from" in again.stdout, again.stdout[-2000:]
    assert "> explained 4 configurations: 0 now, 4 kept in" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == command
    # as printed, from the root, in a shell whose PATH lacks the environment's bin
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != Path(sys.executable).parent)
    trained = subprocess.run(command, shell=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": path},
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert sorted(tb_scalars(str(tmp_path / "tb"), "lm loss")) == [1, 2]  # the trials wrote no TensorBoard there


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size: the tuner chooses these"),
        (["--micro-batch-sizes", "0,-1"], "--micro-batch-sizes 0,-1: each must be >= 1"),
        (["--nproc-per-node", "0"], "--nproc-per-node 0 must be >= 1"),
        (["--tp", "0"], "--tp 0 must be >= 1"),
        (["--cp", "1,0"], "--cp 1,0: each must be >= 1"),
        (["--", "--context-parallel-size", "2"], "--context-parallel-size: the tuner chooses these"),
        (["--zero", "0,4"], "--zero 0,4: choose from 0,1,2,3"),
        (["--recompute", "none,half"], "--recompute half: choose from none,selective,full"),
        (["--memory-budget-gib", "0"], "--memory-budget-gib 0.0 must be > 0"),
    ],
)
def test_bad_tuner_input_is_one_line_naming_the_flag(argv, message, tmp_path, capsys):
    from tools import autotune

    with pytest.raises(SystemExit) as exit_:
        autotune.main([*argv, "--results", str(tmp_path / "r.jsonl")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(f"autotune.py: error: {message}"), err
    assert not (tmp_path / "r.jsonl").exists()  # refused before anything was explained


def test_the_commands_it_prints_run_under_the_python_it_runs_under(tmp_path, monkeypatch):
    """The repository's ``.venv/bin/torchrun`` (relative: the commands run from the root), else
    this Python's ``-m torch.distributed.run``; never a bare ``torchrun`` (it may not be on the PATH)."""
    from tools import autotune

    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "torchrun").touch()
    monkeypatch.setattr(autotune, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert shlex.split(autotune.command("gpt", 2, ["--lr", "1e-3"], ["--micro-batch-size", "4"])) == [
        ".venv/bin/torchrun", "--standalone", "--nproc_per_node=2", "pretrain_gpt.py", "--lr", "1e-3",
        "--micro-batch-size", "4"]  # fmt: skip
    monkeypatch.setattr(sys, "executable", "/opt/python/bin/python3")
    assert autotune.launcher() == ["/opt/python/bin/python3", "-m", "torch.distributed.run"]


def test_the_readme_example_plans_tensor_parallel_points_with_gpt_tp(tmp_path):
    """Without ``--schedule`` a TP2 point plans (and trains) with the family's own schedule."""
    from tools import autotune

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "8", "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    flags = autotune.flags_of({"tp": 2, "pp": 1, "sp": True, "zero": 0, "mbs": 4, "recompute": "none"})
    cost = autotune._planner("gpt", [*base, "--train-iters", "2", "--eval-iters", "0"], 2)(flags)  # refused before
    assert cost.peak > 0 and cost.traffic > 0  # the tensor-parallel all-gathers and reduce-scatters
    assert autotune.schedule_of("gpt", [*base, *flags]).startswith("gpt_tp, the default for gpt2")


def test_an_moe_model_gets_expert_parallel_sizes_that_divide_its_experts_and_data_parallel_ranks():
    from tools import autotune

    ask = autotune_args(["--sp", "off", "--recompute", "none", "--micro-batch-sizes", "1", "--zero", "0,1,2"])
    points = list(autotune.gpt_space(4, 2, 4, 8, ask, experts=6))
    by_layout = {(p["tp"], p["pp"], p["zero"]): sorted({q["ep"] for q in points if (q["tp"], q["pp"], q["zero"]) ==
                                                      (p["tp"], p["pp"], p["zero"])}) for p in points}  # fmt: skip
    assert by_layout[(1, 1, 0)] == [1, 2] and by_layout[(1, 1, 1)] == [1, 2]  # 4 does not divide 6 experts
    assert by_layout[(1, 1, 2)] == [1]  # ZeRO-2 (DeepSpeed) runs no expert parallelism
    assert by_layout[(4, 1, 0)] == [1]  # no data-parallel ranks to carve from
    flags = autotune.flags_of(next(p for p in points if p["ep"] == 2))
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    dense = list(autotune.gpt_space(4, 2, 4, 8, ask))
    assert {p["ep"] for p in dense} == {1} and "--expert-model-parallel-size" not in autotune.flags_of(dense[0])


def test_context_parallel_sizes_are_searched_where_asked_and_the_trainer_takes_them():
    """--cp lists the sizes (default 1: the exchange only pays for long sequences); a point keeps
    one where validation does: it divides the ranks left by TP x PP and the sequence into 2C chunks,
    not with DeepSpeed's ZeRO-2/3, each rank's tokens dividing over TP under sequence parallelism."""
    from tools import autotune

    ask = autotune_args(["--cp", "1,2,4", "--recompute", "none", "--micro-batch-sizes", "1,2"])
    points = list(autotune.gpt_space(8, 2, 4, 8, ask, seq=12))  # 12 tokens: 4 chunks of 3, not 8
    assert {p["cp"] for p in points} == {1, 2}
    assert all(8 % (p["tp"] * p["pp"] * p["cp"]) == 0 for p in points)
    assert not [p for p in points if p["cp"] == 2 and p["zero"] >= 2]
    sp = {(p["tp"], p["cp"]): sorted({q["sp"] for q in points if (q["tp"], q["cp"]) == (p["tp"], p["cp"])})
          for p in points}  # fmt: skip
    assert sp[(2, 2)] == [False, True] and sp[(4, 2)] == [False]  # 6 tokens a rank: over TP 2, not TP 4
    # TP4 x CP2 on 8 ranks: one data-parallel rank (the whole batch of 8 a step), two copies of the weights
    at_tp4 = [p for p in points if p["tp"] == 4 and p["pp"] == 1 and p["cp"] == 2]
    assert {p["zero"] for p in at_tp4} == {0, 1} and {p["mbs"] for p in at_tp4} == {1, 2}
    flags = autotune.flags_of(at_tp4[0])
    assert flags[flags.index("--context-parallel-size") + 1] == "2"
    plain = list(autotune.gpt_space(8, 2, 4, 8, autotune_args([]), seq=12))
    assert {p["cp"] for p in plain} == {1} and "--context-parallel-size" not in autotune.flags_of(plain[0])


def test_when_nothing_fits_the_tuner_suggests_context_parallelism(tmp_path, capsys):
    from tools import autotune

    argv = ["--nproc-per-node", "2", "--tp", "1", "--pp", "1", "--sp", "off", "--zero", "0", "--micro-batch-sizes", "4",
            "--recompute", "none", "--memory-budget-gib", "0.0001", "--results", str(tmp_path / "r.jsonl"), "--",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "8", "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        autotune.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "every configuration is over the memory budget: --cp 1,2,4" in err, err


def autotune_args(argv):
    """The tuner's own candidate flags, parsed as its main() parses them."""
    from tools import autotune

    return autotune.parser().parse_known_args(argv)[0]


def test_fp8_recipes_are_a_dimension_where_asked_with_bf16():
    """--fp8 lists the recipes (bf16 alone: none); an FP8 point's flags carry --fp8-format (the fixed
    flags', else hybrid) and its --fp8-recipe, a bf16 point neither; FP8 without --bf16 is refused."""
    from tools import autotune

    ask = autotune_args(["--fp8", "none,tensorwise,rowwise", "--sp", "off", "--recompute", "none",
                         "--micro-batch-sizes", "1", "--zero", "0"])  # fmt: skip
    assert autotune.fp8_candidates(ask, ["--bf16"]) == ["--bf16"]
    points = list(autotune.gpt_space(2, 2, 4, 8, ask))
    assert sorted({p["fp8"] for p in points}) == ["hybrid/rowwise", "hybrid/tensorwise", "none"]
    plain = autotune.flags_of(next(p for p in points if p["fp8"] == "none"))
    assert "--fp8-recipe" not in plain and "--fp8-format" not in plain
    flags = autotune.flags_of(next(p for p in points if p["fp8"] == "hybrid/rowwise"))
    assert flags[flags.index("--fp8-format") + 1] == "hybrid" and flags[flags.index("--fp8-recipe") + 1] == "rowwise"
    given = autotune_args([])
    assert autotune.fp8_candidates(given, ["--bf16", "--fp8-format=e4m3"]) == ["--bf16"]
    assert given.fp8 == ["e4m3/tensorwise", "e4m3/rowwise"]
    bf16 = autotune_args([])
    assert autotune.fp8_candidates(bf16, ["--bf16"]) == ["--bf16"]
    assert "fp8" not in next(iter(autotune.gpt_space(2, 2, 4, 8, bf16)))
    with pytest.raises(ConfigError, match=r"^--fp8 tensorwise: FP8 needs --bf16 among the trainer's flags"):
        autotune.fp8_candidates(autotune_args(["--fp8", "tensorwise"]), [])
    with pytest.raises(ConfigError, match=r"^--fp8 delayed: choose from none,tensorwise,rowwise"):
        autotune.fp8_candidates(autotune_args(["--fp8", "delayed"]), ["--bf16"])
