"""Every command README.md and examples/ show, run as a newcomer types it after ``tools/setup.sh``.

The commands are parsed from the documents themselves (README.md's ``bash`` blocks and inline
code spans, the indented command lines of examples/' comments and docstrings), so a README change
that breaks one fails here. Each runs from the repository root with a PATH that has no
``.venv/bin`` (the commands name ``.venv/bin/...`` themselves), made cheap by the table ``CHEAP``:
a tiny model and two iterations where the README shows a long run, ``--dry-run`` for SLURM and
``examples/single_node.sh``, ``--help`` for a server; a whole benchmark is left to
``tests/test_cli.py``. The paths the commands write (``ckpt/``, ``runs/``, ...) are ignored by git,
and here point into the test's own folder.

The always-run part (seconds) parses, checks the table and runs the cheap commands; the runs that
start the training stack (about ten launches, minutes on two cores) are marked ``slow``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())
# What a documented command may start with: the venv's programs (no activation needed) or a script.
ALLOWED_PROGRAM = re.compile(r"^(\.venv/bin/\S+|bash|sbatch)$")
# Code that starts with one of these is a command (its program is then checked against the above).
PROGRAM = re.compile(r"^(\.venv/bin/|bash |sbatch |python3? |torchrun |pip3? |pytest |tensorboard |ruff |lint-imports)")
# Paths the documented commands write relative to the repository root: git ignores them, and here
# they are redirected into the test's folder (corpus.jsonl is the user's input, written here).
OUTPUTS = ("ckpt/", "hf/", "tok/", "data/", "runs/", "curves.png", "autotune-results.jsonl")
INPUTS = ("corpus.jsonl",)

TINY_MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
              "--micro-batch-size 2 --global-batch-size 4")  # fmt: skip
SHORT_RUN = "--train-iters 2 --eval-interval 2 --eval-iters 1 --log-interval 1 --tensorboard-dir runs/test"


@dataclasses.dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # as documented: continuations joined, comments dropped

    @property
    def text(self) -> str:
        return shlex.join(self.words)


@dataclasses.dataclass(frozen=True)
class Case:
    """What a reader runs in one go: a README ``bash`` block's commands in order, or one command."""

    source: str  # file:line
    commands: tuple[Command, ...]


@dataclasses.dataclass(frozen=True)
class Cheap:
    """How to make the commands ``pattern`` matches cheap (every matching rule applies, in order)."""

    pattern: str  # re.search on the command's text
    why: str
    skip: bool = False  # not run at all (why says who runs it)
    replace: tuple[tuple[str, str], ...] = ()  # text replacements
    append: str = ""
    slow: bool = False  # starts the training stack


# fmt: off
CHEAP = (
    Cheap(r"^bash tools/setup\.sh$", "made the .venv this suite runs in (CI runs it first)", skip=True),
    Cheap(r"^\.venv/bin/python -m pytest", "the suite itself", skip=True),
    Cheap(r"^bash tools/gpu_check\.sh", "needs a CUDA GPU (its tests skip without one)", skip=True),
    Cheap(r"tools/bench(_suites|_collectives|_moe|_context)?\.py", "a whole benchmark: tests/test_cli.py, "
          "test_bench_moe.py and test_bench_context.py run them small", skip=True),
    Cheap(r"^sbatch ", "SLURM's submission: the script's own dry run", replace=(("sbatch ", "bash "),),
          append="--dry-run"),
    Cheap(r"^bash examples/(slurm/|single_node)(?!.*--dry-run)", "every GPU's command, printed", append="--dry-run"),
    Cheap(r"tensorboard --logdir", "a server: --help", append="--help"),
    Cheap(r"tools/plot\.py runs ", "runs/: a run's events, written here (not this checkout's runs)",
          replace=(("plot.py runs ", "plot.py runs/ "),), slow=True),
    Cheap(r"--nproc_per_node 8 ", "8 ranks on a small machine: 2",
          replace=(("--nproc_per_node 8 ", "--nproc_per_node 2 "),)),
    Cheap(r" \.\.\.( |$)", "'...' stands for your flags: a tiny model", replace=((" ...", " " + TINY_MODEL),)),
    Cheap(r"pretrain_gpt\.py .*--num-layers 24 ", "Megatron's model sizes: a tiny model", append=TINY_MODEL),
    Cheap(r"pretrain_\w+\.py\b", "two iterations", append=SHORT_RUN, slow=True),
    Cheap(r"examples/train_gpt_tp\.py", "two steps", replace=(("--steps 40", "--steps 2"),), slow=True),
    Cheap(r"tools/autotune\.py", "one point of the space, one step", replace=((" -- ", (
        " --tp 2 --pp 1 --sp off --zero 0 --micro-batch-sizes 2 --recompute none --warmup 0 --steps 1"
        " --confirm-rounds 0 --results autotune-results.jsonl -- ")),), slow=True),
    Cheap(r"tools/(train_tokenizer|preprocess_data|convert_checkpoint|explain|loc)\.py", "as written (the stack's "
          "import)", slow=True),
)
# fmt: on


def _code_spans(markdown: str) -> list[tuple[int, str]]:
    """(line, text) of each inline code span outside fenced blocks, whitespace folded."""
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), markdown, flags=re.S | re.M)
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", prose)]  # fmt: skip


def _shell_commands(lines: list[str]) -> list[Command]:
    """Commands in shell lines (comments already off): continuations joined, ``&&`` and lines split."""
    words = shlex.split(re.sub(r"\\\n", " ", "\n".join(lines)).replace("\n", " ; "))
    commands, current = [], []
    for word in [*words, ";"]:
        if word in ("&&", ";"):
            commands += [Command(tuple(current))] if current else []
            current = []
        else:
            current.append(word)
    return commands


def readme_cases(path: Path = ROOT / "README.md") -> list[Case]:
    text = path.read_text()
    cases = []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        lines = [re.sub(r"\s+#\s.*$", "", line) for line in block.group(1).splitlines()]  # comments off
        first = text.count("\n", 0, block.start()) + 2  # the line after the fence
        cases.append(Case(f"{path.name}:{first}", tuple(_shell_commands(lines))))
    for line, span in _code_spans(text):
        if PROGRAM.match(span) and " " in span:  # a single word names a program; a command has arguments
            cases.append(Case(f"{path.name}:{line}", tuple(_shell_commands([span]))))
    return cases


def example_cases(path: Path) -> list[Case]:
    """The commands an example shows: its comments' (shell) or docstring's (Python) indented lines."""
    source = path.relative_to(ROOT).as_posix()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        numbered = [(i + 1, line[4:]) for i, line in enumerate(doc.splitlines()) if line.startswith("    ")]
    else:  # an indented line in a comment is code, as in a docstring
        numbered = [(i + 1, m.group(1)) for i, line in enumerate(path.read_text().splitlines())
                    if (m := re.match(r"^#\s{2,}(\S.*)$", line))]  # fmt: skip
    cases, inside = [], False
    for number, line in numbered:
        if inside or PROGRAM.match(line.strip()):
            if not inside:
                cases.append((number, []))
            cases[-1][1].append(re.sub(r"\s+#\s.*$", "", line.strip()))
            inside = line.rstrip().endswith("\\")
    return [Case(f"{source}:{n}", tuple(_shell_commands(lines))) for n, lines in cases]


def documented_cases() -> list[Case]:
    """Every case of README.md and examples/, each command once (the quick start is shown twice)."""
    seen, cases = set(), []
    for case in readme_cases() + [c for path in EXAMPLES for c in example_cases(path)]:
        commands = tuple(c for c in case.commands if c.words not in seen)
        seen.update(c.words for c in commands)
        cases += [Case(case.source, commands)] if commands else []
    return cases


def rules_for(command: Command) -> list[Cheap]:
    return [rule for rule in CHEAP if re.search(rule.pattern, command.text)]


def cheap_words(command: Command, workdir: Path | None = None) -> list[str] | None:
    """The command as the table makes it cheap (None: not run), its paths in OUTPUTS and INPUTS
    moved under ``workdir`` (where given)."""
    text = command.text
    for rule in rules_for(command):
        if rule.skip:
            return None
        for old, new in rule.replace:
            text = text.replace(old, new)
        text = f"{text} {rule.append}".strip()
    return [_redirect(word, workdir) if workdir else word for word in shlex.split(text)]


def _path(word: str) -> str:
    """The path a word may give: ``--flag=PATH`` or the word itself."""
    return word.partition("=")[2] if word.startswith("--") and "=" in word else word


def _redirect(word: str, workdir: Path) -> str:
    path = _path(word)
    return word[: len(word) - len(path)] + str(workdir / path) if path.startswith(OUTPUTS + INPUTS) else word


def venv_free_env() -> dict[str, str]:
    """This environment without the venv: its bin off PATH, no VIRTUAL_ENV (a newcomer's shell)."""
    venv = str(ROOT / ".venv")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not os.path.abspath(p).startswith(venv)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1"}


CASES = documented_cases()
COMMANDS = [command for case in CASES for command in case.commands]


def _param(case: Case):
    rules = [rule for command in case.commands for rule in rules_for(command)]
    marks = [pytest.mark.slow] if any(rule.slow for rule in rules) else []
    if all(any(rule.skip for rule in rules_for(c)) for c in case.commands):
        marks.append(pytest.mark.skip(reason="; ".join(rule.why for rule in rules if rule.skip)))
    return pytest.param(case, id=case.source, marks=marks)


def test_every_documented_command_runs_with_the_venv_or_a_script():
    """One way after setup: ``.venv/bin/...``, ``bash ...`` or ``sbatch ...``, never a bare ``python``
    or ``torchrun`` (not on a newcomer's PATH); the scripts the commands name exist."""
    assert len(COMMANDS) >= 20, [c.text for c in COMMANDS]
    bare = [
        f"{case.source}: {c.text}" for case in CASES for c in case.commands if not ALLOWED_PROGRAM.match(c.words[0])
    ]
    assert not bare, "write these as .venv/bin/python ... or .venv/bin/torchrun ...:\n" + "\n".join(bare)
    for case in CASES:
        for command in case.commands:
            scripts = [w for w in command.words if re.fullmatch(r"[\w./-]+\.(py|sh|sbatch)", w)]
            assert all((ROOT / s).is_file() for s in scripts), f"{case.source}: {command.text}"


def test_every_cheap_rule_still_matches_a_documented_command():
    """The table follows the documents: a rule no command needs any more goes with it."""
    unused = [rule.pattern for rule in CHEAP if not any(re.search(rule.pattern, c.text) for c in COMMANDS)]
    assert not unused


def test_what_the_commands_write_in_the_repository_is_ignored_by_git(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = sorted({_path(w) for c in COMMANDS for w in cheap_words(c) or () if _path(w).startswith(OUTPUTS)})
    assert {w.split("/")[0] for w in written} >= {"ckpt", "hf", "tok", "data", "runs"}, written
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *written],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert [line for line in proc.stdout.splitlines() if line.startswith("::")] == [], proc.stdout


def test_the_results_files_docs_autotune_names_are_ignored_by_git():
    """docs/autotune.md (not among the cases above) has the tuner write ``--results FILE`` in the
    repository root: git ignores those files there, and only there (the page's own records under
    docs/benchmarks/ stay tracked)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    written = sorted(set(re.findall(r"--results ([\w./-]+)", (ROOT / "docs" / "autotune.md").read_text())))
    assert "tuned.jsonl" in written, written
    recorded = [str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "benchmarks").rglob("*.jsonl")]
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *written, *recorded],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    not_ignored = sorted(line.split("\t")[1] for line in proc.stdout.splitlines() if line.startswith("::"))
    assert not_ignored == sorted(recorded), proc.stdout


def test_an_entry_point_started_by_a_python_without_torch_reruns_with_the_venv():
    """``python3 tools/....py`` (a system Python: no torch) re-executes under ``.venv/bin/python``."""
    python = shutil.which("python3", path=venv_free_env()["PATH"])
    if python is None or not (ROOT / ".venv/bin/python").exists():
        pytest.skip("no python3 outside the venv, or no .venv")
    probe = "import importlib.util; print(importlib.util.find_spec('torch') is None)"
    if subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip() != "True":
        pytest.skip(f"{python} can import torch: nothing to re-run")
    code = "import sys; sys.path.insert(0, 'tools'); import repo_python; print(sys.prefix)"
    proc = subprocess.run([python, "-c", code], cwd=ROOT, env=venv_free_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).resolve() == (ROOT / ".venv").resolve()


def test_the_reexecution_happens_only_without_torch_with_a_venv_and_once(tmp_path, monkeypatch):
    from tools import repo_python

    assert repo_python.reexec_command(tmp_path) is None  # this interpreter has torch
    monkeypatch.setattr(repo_python.importlib.util, "find_spec", lambda name: None)  # as if it had not
    assert repo_python.reexec_command(tmp_path) is None  # no .venv there
    python = tmp_path / ".venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.chmod(0o755)
    assert repo_python.reexec_command(tmp_path) == [str(python), *sys.orig_argv[1:]]
    monkeypatch.setenv("MEGATRON_SLAPO_REEXECUTED", "1")  # the re-executed process: never again
    assert repo_python.reexec_command(tmp_path) is None
    assert "MEGATRON_SLAPO_REEXECUTED" not in os.environ  # and its children start afresh
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))  # the venv itself, without torch
    assert repo_python.reexec_command(tmp_path) is None


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_the_documented_commands_run(case: Case, tmp_path: Path):
    """Each case's commands in order, in one shell (PATH without .venv/bin) from the repository root."""
    if not (ROOT / ".venv/bin/python").exists():
        pytest.skip("no .venv (tools/setup.sh makes it)")
    if any("corpus.jsonl" in c.words for c in case.commands):
        _write_corpus(tmp_path / "corpus.jsonl")
    if any("tools/plot.py" in c.words for c in case.commands):
        _write_events(tmp_path / "runs/a")
    for words in filter(None, (cheap_words(c, tmp_path) for c in case.commands)):
        proc = subprocess.run(words, cwd=ROOT, env=venv_free_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{case.source}: {shlex.join(words)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _write_corpus(path: Path) -> None:
    """A small JSON-lines corpus: the help topics that ship with Python, a document each."""
    from pydoc_data.topics import topics

    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in topics.values()))


def _write_events(run: Path) -> None:
    """A run's TensorBoard scalars, as the trainer tags them."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run)) as writer:
        for step in range(1, 4):
            writer.add_scalar("lm loss", 8.0 - step, step)
            writer.add_scalar("throughput(tps)", 1000.0 + step, step)


if __name__ == "__main__":  # what runs here for each documented command
    for case in CASES:
        for command in case.commands:
            words = cheap_words(command, Path("$TMP"))
            print(f"{case.source}: {command.text}\n    -> {shlex.join(words) if words else 'not run'}")
