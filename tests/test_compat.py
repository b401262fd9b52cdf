"""megatron_slapo/compat/ holds every third-party private name and patch; the rest of our code uses none.

The scan parses our sources (the library but compat/, schedules/, tools/, pretrain_*.py) and lists
each use of another package's private name or a patch of another package:

- an import of a private module (``torch._dynamo``) or of a private name (``from X import _y``);
- an attribute ``obj._name``, or a string ``"_name"`` (``getattr(m, "_name")``, ``"_name" in
  vars(m)``), that is not ours. The scan cannot tell what type ``obj`` has, so a private name is
  ours where our own code defines it (a function, class, parameter, module global, class attribute
  or ``self._name = ...``) and no third-party class we import has it too; a name both have (ours
  and ``nn.Module._apply``) is ours only as ``self._name`` inside a class of ours that defines it.
  On an imported third-party module or class (``nn.Module._apply``) a private name is never ours;
- a class of ours defining a private name one of its third-party base classes has (an override of,
  or an assignment to, another package's private attribute), except documented hooks (:data:`HOOKS`);
- an attribute of an imported third-party module or class assigned or deleted while it holds a
  function or class (a patch; a plain setting such as ``torch.backends.cudnn.benchmark`` is not).

The versions check (compat/versions.py) is tested here too.
"""

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
from packaging.specifiers import SpecifierSet

from megatron_slapo.compat import versions
from megatron_slapo.engines.deepspeed_zero import _import_deepspeed
from megatron_slapo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / "megatron_slapo" / "compat"
OURS = {"megatron_slapo", "schedules", "tools", "tests"} | {p.stem for p in ROOT.glob("pretrain_*.py")}
# Private names a subclass is meant to define: transformers' "adding a new model" guide has every
# PreTrainedModel define _init_weights (calling it on another model is still compat's).
HOOKS = {"_init_weights"}
# The standard library's documented functions whose names begin with an underscore: public API, not
# a private name (os._exit: leaving a process without the interpreter's shutdown, error_report.py).
DOCUMENTED = {"os._exit"}


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` is a dunder, public by convention, and ``_`` a placeholder."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def is_ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def library_files() -> list[Path]:
    """Every file the scan reads: compat/ is where the private names belong, so it is left out."""
    files = [*ROOT.glob("megatron_slapo/**/*.py"), *ROOT.glob("schedules/**/*.py"), *ROOT.glob("tools/**/*.py")]
    return sorted([f for f in files if COMPAT not in f.parents] + list(ROOT.glob("pretrain_*.py")))


def _annotations(cls: type) -> dict[str, object]:
    """The attributes a class declares in its body's annotations (``nn.Module._parameters``)."""
    annotations = vars(cls).get("__annotations__")
    return annotations if isinstance(annotations, dict) else {}  # a C type's is a descriptor


def third_party_private_names(trees: list[ast.Module]) -> set[str]:
    """Private names the third-party classes ``trees`` import (directly or in an imported module),
    and their bases, have in their namespaces or annotations: ``_apply``, ``_parameters``, ..."""
    classes = set()
    for tree in trees:
        for dotted in _third_party_imports(tree).values():
            try:
                with warnings.catch_warnings():  # what a module says as it is imported ("Apex is not installed")
                    warnings.simplefilter("ignore")
                    value = _resolve(dotted)
            except (ImportError, AttributeError):
                continue
            values = vars(value).values() if isinstance(value, ModuleType) else [value]
            classes |= {k for v in values if isinstance(v, type) for k in v.__mro__ if k is not object}
    return {name for k in classes for name in [*vars(k), *_annotations(k)] if is_private(name)}


def _scope_names(body: list[ast.stmt]) -> set[str]:
    """Names assigned at the top of a module or class body (globals, class attributes), nested classes' too."""
    names = set()
    for stmt in body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        names |= {n.id for target in targets if target for n in ast.walk(target) if isinstance(n, ast.Name)}
        if isinstance(stmt, ast.ClassDef):
            names |= _scope_names(stmt.body)
    return names


def own_private_names(trees: list[ast.Module]) -> set[str]:
    """Private identifiers our own code defines: functions, classes, parameters, ``self._x = ...``,
    class-body assignments and module globals."""
    names = set()
    for tree in trees:
        names |= _scope_names(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return {name for name in names if is_private(name)}


def ours_anywhere(trees: list[ast.Module], overridden: set[str]) -> set[str]:
    """The private names that are ours on any object: those ``trees`` define, less those a class of
    ours overrides (``overridden``) and those a third-party class has too (``_apply``)."""
    return own_private_names(trees) - overridden - third_party_private_names(trees)


def _third_party_imports(tree: ast.Module) -> dict[str, str]:
    """The names a file binds to a third-party module or to something imported from one, with
    what they are bound to (``nn`` -> ``torch.nn``)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not is_ours(a.name):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not is_ours(node.module):
            bound |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
    return bound


def _resolve(dotted: str) -> object:
    """The object a dotted path names (a module, or attributes below the longest importable one)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return functools.reduce(getattr, parts[i:], value)
    raise ImportError(dotted)


def _is_patch(target: ast.expr, imports: dict[str, str]) -> bool:
    """Whether assigning ``target`` (``mod.attr``, ``Class.attr``) replaces a third-party function or
    class, or adds an attribute to a third-party module or class."""
    chain = []
    while isinstance(target, ast.Attribute):
        chain.insert(0, target.attr)
        target = target.value
    if chain and isinstance(target, (ast.Call, ast.Subscript)):  # importlib.import_module(...).f, sys.modules[...].f
        return ast.unparse(target).startswith(("importlib.import_module(", "sys.modules["))
    if not (isinstance(target, ast.Name) and target.id in imports):
        return False
    try:
        value = _resolve(".".join([imports[target.id], *chain]))
    except (ImportError, AttributeError):
        return True
    return callable(value)


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # a class defined in C
        return ""


def _defined_private(node: ast.ClassDef) -> list[tuple[str, int]]:
    """The private names a class body defines (methods, class attributes) or its methods set on ``self``."""
    found = [(s.name, s.lineno) for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    found += [(name, node.lineno) for name in _scope_names(node.body)]
    found += [
        (n.attr, n.lineno)
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        and isinstance(n.value, ast.Name) and n.value.id == "self"
    ]  # fmt: skip
    return [(name, line) for name, line in found if is_private(name)]


def overrides(tree: ast.Module, module: ModuleType, label: str) -> list[tuple[str, str]]:
    """``(name, "label:line name (...)")`` for each private name a class of ``module`` defines that
    a third-party base class of it has too (in its namespace, or anywhere in its source)."""
    found = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [k for k in getattr(module, node.name).__mro__[1:] if not is_ours(k.__module__) and k is not object]
        for name, line in _defined_private(node):
            owner = next((k for k in bases if name in vars(k) or re.search(rf"\b{name}\b", _source(k))), None)
            if owner is not None:
                found.append((name, f"{label}:{line} {name} (of {owner.__module__}.{owner.__qualname__})"))
    return found


def _class_members(tree: ast.Module) -> dict[int, set[str]]:
    """For each ``self._x`` or ``cls._x`` inside a class of ``tree`` (by node id), the private names
    that class, the innermost one, defines."""
    members = {}
    for cls in ast.walk(tree):  # outer classes first: an inner one's names replace theirs
        if isinstance(cls, ast.ClassDef):
            defined = {name for name, _ in _defined_private(cls)}
            for node in ast.walk(cls):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                ):
                    members[id(node)] = defined
    return members


def _on_third_party(node: ast.Attribute, imports: dict[str, str]) -> bool:
    """Whether ``node`` is an attribute of an imported third-party module or class (``nn.Module._apply``)."""
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    return isinstance(value, ast.Name) and value.id in imports


def private_uses(path: Path, own: set[str], label: str) -> list[str]:
    """Each third-party private name or patch in ``path``, as ``label:line what`` (overrides aside).

    ``own``: the private names that are ours on any object (those our code defines that no
    third-party class has too); a name a class of ours defines is ours on its ``self`` as well."""
    tree = ast.parse(path.read_text(), str(path))
    imports, members = _third_party_imports(tree), _class_members(tree)
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if not is_ours(a.name) and any(map(is_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not is_ours(node.module):
            private_module = any(map(is_private, node.module.split(".")))
            names = [f"{node.module}.{a.name}" for a in node.names if private_module or is_private(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and ast.unparse(node) not in DOCUMENTED:
            ours = node.attr in own or node.attr in members.get(id(node), ())
            names = [f".{node.attr}"] if _on_third_party(node, imports) or not ours else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
            if node.value.isidentifier() and is_private(node.value) and node.value not in own:
                names = [repr(node.value)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in imports:
                names = [f"patch {node.func.id}({node.args[0].id}, ...)"]
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            names += [f"patch {ast.unparse(t)}" for t in targets if _is_patch(t, imports)]
        found += [f"{label}:{node.lineno} {name}" for name in names]
    return found


def _subclasses_something(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ClassDef) and node.bases for node in tree.body)


def test_no_third_party_private_names_outside_compat():
    files = library_files()
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    found, overridden = [], set()
    for f, tree in trees.items():
        if _subclasses_something(tree):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for private, where in overrides(tree, importlib.import_module(name), str(f.relative_to(ROOT))):
                overridden.add(private)
                found += [] if private in HOOKS else [where]
    own = ours_anywhere([*trees.values(), *(ast.parse(f.read_text()) for f in COMPAT.glob("*.py"))], overridden)
    found += [use for f in files for use in private_uses(f, own, str(f.relative_to(ROOT)))]
    print("\n".join(found))
    assert not found, "third-party private names outside megatron_slapo/compat/:\n" + "\n".join(found)


PLANTED = """\
import importlib

import torch._dynamo
import torch.backends.cudnn
from torch import nn
from torch.fx.experimental.meta_tracer import MetaTracer
from torch.nn.modules.conv import _ConvNd


class Tracer(MetaTracer):
    def trace_ours(self, x, sch):
        self._disable_module_getattr = True
        sch._error("ours")
        getattr(x, "_buffers")
        nn.Module.__call__ = None
        torch.backends.cudnn.benchmark = True  # a setting, not a patch
        importlib.import_module("deepspeed.comm.torch").build_shm_op = None
        return x._parameters


class Ours:
    def _apply(self, fn):  # a name of ours that torch's nn.Module has too
        return fn(self)

    def run(self, module):
        self._apply(print)  # ours: this class defines it
        module._apply(print)  # nn.Module._apply, as far as the scan can tell
        nn.Module._apply(module, print)
        return getattr(module, "_apply")
"""


def test_scan_finds_planted_private_names(tmp_path):
    own = ours_anywhere([ast.parse(f.read_text(), str(f)) for f in library_files()] + [ast.parse(PLANTED)], set())
    planted = tmp_path / "planted.py"
    planted.write_text(PLANTED)
    spec = importlib.util.spec_from_file_location("planted", planted)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [where for _, where in overrides(ast.parse(PLANTED), module, "planted.py")]
    found += private_uses(planted, own, "planted.py")
    assert sorted(found) == [
        "planted.py:12 _disable_module_getattr (of torch.fx.experimental.meta_tracer.MetaTracer)",
        "planted.py:14 '_buffers'",
        "planted.py:15 patch nn.Module.__call__",
        "planted.py:17 patch importlib.import_module('deepspeed.comm.torch').build_shm_op",
        "planted.py:18 ._parameters",
        "planted.py:27 ._apply",
        "planted.py:28 ._apply",
        "planted.py:29 '_apply'",
        "planted.py:3 torch._dynamo",
        "planted.py:7 torch.nn.modules.conv._ConvNd",
    ]


def test_supported_ranges_are_the_requirements_and_admit_the_tested_versions():
    requirements = (ROOT / "requirements.txt").read_text()
    pins = re.findall(r"^(torch|transformers|megatron-core|deepspeed|torchao)([<>=!~][^\s#]*)", requirements, re.M)
    assert dict(pins) == {k: v for k, v in versions.SUPPORTED.items() if k != "python"}
    assert versions.TESTED.keys() == versions.SUPPORTED.keys()
    assert all(SpecifierSet(versions.SUPPORTED[k]).contains(v) for k, v in versions.TESTED.items())
    setup = (ROOT / "tools" / "setup.sh").read_text()
    assert re.findall(r'"torch==([^"]+)"', setup) == [versions.TESTED["torch"]]


def installed(monkeypatch: pytest.MonkeyPatch, **found: str) -> None:
    """Make the check see the tested versions but ``found`` (``megatron_core="0.15.0"``)."""
    found = {**versions.TESTED, "python": "3.11.7", **{k.replace("_", "-"): v for k, v in found.items()}}
    monkeypatch.setattr(versions, "installed_version", found.get)


@pytest.mark.parametrize(
    "found, line",
    [
        (
            {"transformers": "5.30.0"},
            "transformers 5.30.0 is outside the supported range >=5.0,<5.25 (tested: 5.24.0); "
            "install the tested version: pip install 'transformers==5.24.0'",
        ),
        (
            {"torch": "2.9.1+cu128"},
            "torch 2.9.1+cu128 is outside the supported range >=2.11,<2.14 (tested: 2.13.0); "
            "install the tested version: pip install 'torch==2.13.0'",
        ),
        (
            {"python": "3.13.1"},
            "Python 3.13.1 is outside the supported range >=3.11,<3.13 (tested: 3.11); "
            "use Python 3.11 (PYTHON=python3.11 bash tools/setup.sh, for a new .venv)",
        ),
        (
            {"torch": "2.14.0rc1", "megatron_core": "0.17.0"},
            "torch 2.14.0rc1 is outside the supported range "
            ">=2.11,<2.14 (tested: 2.13.0), megatron-core 0.17.0 is outside the supported range >=0.16.1,<0.17 "
            "(tested: 0.16.1); install the tested versions: pip install 'torch==2.13.0' 'megatron-core==0.16.1'",
        ),
    ],
)
def test_unsupported_versions_are_refused_in_one_line(monkeypatch, found, line):
    installed(monkeypatch, **found)
    with pytest.raises(versions.UnsupportedVersionError) as refused:
        versions.check_versions()
    assert str(refused.value) == line


def test_import_refuses_with_one_line():
    """``import megatron_slapo`` exits with the refusal as its one line, no traceback."""
    found = {**versions.TESTED, "transformers": "5.30.0"}
    fake = "import importlib.metadata, platform; platform.python_version = lambda: '3.11.7'; "
    fake += f"importlib.metadata.version = {found!r}.__getitem__; import megatron_slapo"
    done = subprocess.run([sys.executable, "-c", fake], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["megatron_slapo: error: transformers 5.30.0 is outside the supported range "
                                        ">=5.0,<5.25 (tested: 5.24.0); install the tested version: pip install "
                                        "'transformers==5.24.0'"]  # fmt: skip


def test_supported_but_untested_version_is_noted(monkeypatch):
    installed(monkeypatch, transformers="5.23.0")
    note = (
        r"^transformers 5\.23\.0 is supported \(>=5\.0,<5\.25\) but untested; megatron_slapo was tested with 5\.24\.0$"
    )
    with pytest.warns(versions.UntestedVersionWarning, match=note) as notes:
        versions.check_versions()
    assert len(notes) == 1


def test_tested_versions_pass_quietly(monkeypatch):
    installed(monkeypatch, torch="2.13.0+cpu")  # any build of the tested release, any Python 3.11
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_versions(versions.SUPPORTED)


def test_deepspeed_is_checked_by_its_engine_only(monkeypatch):
    installed(monkeypatch, deepspeed="0.18.0")
    versions.check_versions()  # import megatron_slapo: DeepSpeed is not checked
    with pytest.raises(ConfigError, match=r"^--engine deepspeed: deepspeed 0\.18\.0 is outside the supported range"):
        _import_deepspeed()
