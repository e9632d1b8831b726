"""The rooms' import rules (docs/architecture.md), checked by walking every import statement of the product code.

Product code is mpo/, checkpoints_tools/ and launch/. A package is `mpo.<first name>` (mpo.trainer, mpo.config, ...),
`checkpoints_tools` or `launch`. Module-level and function-level imports both count (a lazy import is still a
dependency); imports under `if TYPE_CHECKING:` do not (annotations only: nothing runs, no load order).

Rules:
- Nothing below the top imports back up into mpo.trainer, mpo.cli or mpo.bench: the data flows one way.
- No cycle between packages.
- mpo imports nothing of checkpoints_tools except in mpo.bench (which measures the converter): checkpoints_tools is a
  tool built on mpo, not a layer under it.
ALLOWED lists today's exceptions, each with the step of issue #29 that removes it; the list only shrinks.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("mpo", "checkpoints_tools", "launch")
TOP = frozenset({"mpo.trainer", "mpo.cli", "mpo.bench"})

# (importing module, imported module): why it is still there.
ALLOWED: dict[tuple[str, str], str] = {}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "mpo" else parts[0]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Yield (line, imported module) for every import outside `if TYPE_CHECKING:`; `from a import b` yields a.b
    instead of a when b is a module of the product."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                here = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                yield node.lineno, sub if _is_module(sub) else base
        stack.extend(ast.iter_child_nodes(node))


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> ["importer -> imported (file:line)", ...] across packages."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            for line, target in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
                if target.split(".")[0] not in PRODUCT or target == "mpo" or module == "mpo":
                    continue
                a, b = _package(module), _package(target)
                if a != b and (module, target) not in ALLOWED:
                    edges[(a, b)].append(f"{module} -> {target} ({path.relative_to(ROOT)}:{line})")
    return edges


def test_nothing_imports_up_into_the_top():
    bad = [w for (a, b), where in _edges().items() if b in TOP and a not in TOP for w in where]
    assert not bad, "imports back up into mpo.trainer/cli/bench:\n" + "\n".join(bad)


def test_mpo_does_not_import_checkpoints_tools():
    bad = [w for (a, b), where in _edges().items()
           if b == "checkpoints_tools" and a.startswith("mpo.") and a != "mpo.bench" for w in where]
    assert not bad, "mpo imports checkpoints_tools:\n" + "\n".join(bad)


def test_no_cycle_between_packages():
    edges = _edges()
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    bad = [w for (a, b), where in sorted(edges.items()) if a in reaches(b) for w in where]
    assert not bad, "imports on a cycle between packages:\n" + "\n".join(bad)


def test_the_walk_sees_lazy_relative_and_type_only_imports():
    """The walker itself, on a made-up module: a function-level import and a relative import count, a
    TYPE_CHECKING import does not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpo.trainer import Trainer\n"
              "def f():\n    from mpo.cli import main\nfrom ..config import TrainConfig\n")
    found = {t for _, t in _imports(ast.parse(source), "mpo.rollout.x", False)}
    assert found == {"typing", "mpo.cli", "mpo.config"}


def test_family_modules_are_reached_only_through_the_family_registry():
    """A model family (mpo.models.families.<name>) is one module registered by path in the registry: nothing outside
    the families package imports one by name (call sites ask mpo.models.families), and the registry imports none of
    its users (no product import at all: it loads the listed modules by path)."""
    registry = ROOT / "mpo" / "models" / "families" / "__init__.py"
    bad = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            for line, target in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
                if path == registry and target.split(".")[0] in PRODUCT:
                    bad.append(f"the registry imports {target} ({path.relative_to(ROOT)}:{line})")
                elif target.startswith("mpo.models.families.") and not module.startswith("mpo.models.families"):
                    bad.append(f"{module} -> {target} ({path.relative_to(ROOT)}:{line})")
    assert not bad, "family modules imported around the registry:\n" + "\n".join(bad)
    from mpo.models.families import BUILTIN_FAMILIES, families

    assert len(families()) == len(BUILTIN_FAMILIES) >= 3


def _assigned_attribute_roots(target: ast.AST):
    """(root name, dotted target) of every attribute a statement's target assigns into (a.b = ..., a.b.c = ...,
    tuples of them)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _assigned_attribute_roots(element)
        return
    if isinstance(target, ast.Starred):
        yield from _assigned_attribute_roots(target.value)
        return
    if not isinstance(target, ast.Attribute):
        return
    node, path = target, []
    while isinstance(node, ast.Attribute):
        path.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        yield node.id, ".".join([node.id, *reversed(path)])


def _assignment_targets(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            yield node, node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            yield node, [node.target]


def test_architecture_the_loop_owns_the_rollouts_and_trainer_is_the_policy():
    """Issue #44 item 2. The Trainer (mpo/trainer/trainer.py) is the policy: it neither holds nor reads the task, the
    Collector or the producer (the loop's rollout side, mpo.trainer.rollouts); no other module of mpo assigns into a
    Trainer's attributes (a variable named `trainer`: nothing patches rollouts or state into it from outside); and no
    module imports a private name from trainer.py (the object broadcast lives in mpo.parallel.collectives)."""
    trainer_py = ROOT / "mpo" / "trainer" / "trainer.py"
    tree = ast.parse(trainer_py.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    rollout_side = {"task", "collector", "producer"}
    held = sorted({f"self.{n.attr} (trainer.py:{n.lineno})" for n in ast.walk(cls)
                   if isinstance(n, ast.Attribute) and n.attr in rollout_side
                   and isinstance(n.value, ast.Name) and n.value.id == "self"})
    assert not held, "the Trainer holds the rollout side:\n" + "\n".join(held)
    patched, private = [], []
    for path in sorted((ROOT / "mpo").rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT)
        if path != trainer_py:
            for node, targets in _assignment_targets(tree):
                patched += [f"{dotted} ({where}:{node.lineno})" for t in targets
                            for root, dotted in _assigned_attribute_roots(t) if root == "trainer"]
        private += [f"{a.name} ({where}:{n.lineno})" for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module == "mpo.trainer.trainer"
                    for a in n.names if a.name.startswith("_")]
    assert not patched, "assignments into a Trainer's attributes outside trainer.py:\n" + "\n".join(patched)
    assert not private, "private names imported from mpo.trainer.trainer:\n" + "\n".join(private)
