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
import functools
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
    its users (no product import but the generic registry type: it loads the listed modules by path)."""
    registry = ROOT / "mpo" / "models" / "families" / "__init__.py"
    bad = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            for line, target in _imports(ast.parse(path.read_text()), module, path.name == "__init__.py"):
                if path == registry and target.split(".")[0] in PRODUCT and target != "mpo.registry":
                    bad.append(f"the registry imports {target} ({path.relative_to(ROOT)}:{line})")
                elif target.startswith("mpo.models.families.") and not module.startswith("mpo.models.families"):
                    bad.append(f"{module} -> {target} ({path.relative_to(ROOT)}:{line})")
    assert not bad, "family modules imported around the registry:\n" + "\n".join(bad)
    from mpo.models.families import BUILTIN_FAMILIES, families

    assert len(families()) == len(BUILTIN_FAMILIES) >= 3


# The config is data at the bottom floor: its sections, loading and coercion need only the parallel layout (a section
# of its own). The checks that ask the registries sit above them, in mpo.config_checks.
CONFIG_IMPORTS = frozenset({"mpo.parallel.config"})


def test_config_imports_nothing_above_it():
    """No import runs up the floors from mpo/config.py: it imports no mpo module but the parallel layout's, at module
    level or lazily (the checks' lazy imports of algorithms, weight_sync, envs, rewards, data and models were the only
    imports that ran back up)."""
    path = ROOT / "mpo" / "config.py"
    bad = sorted({f"mpo.config -> {target} (mpo/config.py:{line})"
           for line, target in _imports(ast.parse(path.read_text()), "mpo.config", False)
           if target.split(".")[0] in PRODUCT and target not in CONFIG_IMPORTS})
    assert not bad, "mpo.config imports above the bottom floor:\n" + "\n".join(bad)


# Who may name TrainConfig, the whole run's config: a module or a package (and everything in it), each with why. A
# lower room takes its own section, or the few fields it needs, so that what it depends on is in its signature.
TRAIN_CONFIG_USERS: dict[str, str] = {
    "mpo.config": "defines it",
    "mpo.config_checks": "checks it across sections",
    "mpo.cli": "entry point: loads it",
    "launch": "entry point: plans a whole run from it",
    "mpo.prestart": "beside the CLI: checks files and engines before any process starts",
    "mpo.model_import": "beside the CLI: converts model.hf_dir before any process starts",
    "mpo.trainer": "the loop, and the rooms it builds from several sections (Trainer, Collector, tasks, evaluation)",
}


def test_config_train_config_is_named_only_by_the_config_and_the_loop():
    """No product module outside TRAIN_CONFIG_USERS names TrainConfig (an import, an annotation, a use; under
    TYPE_CHECKING too: a type-only dependency on the whole config is still one)."""
    bad = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = _module_name(path)
            if any(module == user or module.startswith(user + ".") for user in TRAIN_CONFIG_USERS):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = (isinstance(node, ast.Name) and node.id == "TrainConfig") or (
                    isinstance(node, ast.Attribute) and node.attr == "TrainConfig") or (
                    isinstance(node, ast.alias) and node.name == "TrainConfig")
                if named:
                    bad.append(f"{module} ({path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')})")
                    break
    assert not bad, "TrainConfig named outside the config and the loop:\n" + "\n".join(bad)


# Values derived from several config fields, each worked out in one home (a test reads the code for the old copies).
DERIVED_ONCE: dict[str, tuple[str, str]] = {
    r"engine_dtype or ": ("mpo/config.py", "TrainConfig.engine_dtype (or config.served_dtype)"),
    r"(?<!args)\.bucket_mb\s*<<": ("mpo/config.py", "SyncSection.bucket_bytes"),
    r"max_response_tokens or|max_tokens_per_turn or|max_new_tokens or ": (
        "mpo/config.py", "TrainConfig.response_tokens / eval_new_tokens, RolloutSection.turn_new_tokens"),
    r"<=?\s*3276[78]": ("mpo/rollout/protocol.py", "mpo.rollout.protocol.route_dtype (torch: getattr(torch, .name))"),
}


def test_config_derived_values_are_worked_out_once():
    """The engine dtype, the bucket bytes, a response's token budgets and the expert-id dtype of routes each have one
    home; no product module works one out again."""
    import re

    bad = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for pattern, (home, use) in DERIVED_ONCE.items():
                    if rel != home and re.search(pattern, line):
                        bad.append(f"{rel}:{number}: use {use}: {line.strip()}")
    assert not bad, "a derived value worked out again:\n" + "\n".join(bad)


# -- registries (issue #44 item 5) --------------------------------------------------------------------------------
# Every extension point is one mpo.registry.Registry: module -> the attribute holding it.
EXTENSION_POINTS = {
    "mpo.algorithms.registry": "LOSS_REGISTRY",
    "mpo.algorithms.advantage_registry": "ADVANTAGE_REGISTRY",
    "mpo.rewards.registry": "REWARD_REGISTRY",
    "mpo.envs.registry": "ENV_REGISTRY",
    "mpo.models.families": "FAMILIES",
    "mpo.weight_sync.transports": "TRANSPORTS",
}
# The packages a registry module may import: its room's floor (docs/architecture.md's table) and the shared
# registry machinery. A registry holding more than names and entries (the loss registry also dispatches) imports
# its own package's helpers, never the modules that register into it.
REGISTRY_FLOORS = {
    "mpo.algorithms": {"mpo.algorithms", "mpo.parallel"},
    "mpo.rewards": {"mpo.rewards"},
    "mpo.envs": {"mpo.envs", "mpo.data", "mpo.rewards", "mpo.rollout"},
    "mpo.models": {"mpo.models", "mpo.parallel"},
    "mpo.weight_sync": {"mpo.weight_sync", "mpo.models", "mpo.parallel", "mpo.rollout", "mpo.routing"},
}
REGISTRY_SHARED = {"mpo.registry", "mpo.plugins"}


@functools.lru_cache(maxsize=1)
def _product_trees() -> tuple[tuple[pathlib.Path, str, ast.Module], ...]:
    """(path, module, tree) of every product file, parsed once for the registry tests."""
    return tuple((path, _module_name(path), ast.parse(path.read_text()))
                 for top in PRODUCT for path in sorted((ROOT / top).rglob("*.py")))


def _registry_calls() -> dict[tuple[str, str], tuple[ast.Call, ast.Module]]:
    """(module, name) -> (the call, the module's tree) of every module-level `NAME = Registry(...)` in the product."""
    found = {}
    for path, module, tree in _product_trees():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            call = getattr(node, "value", None)
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None))
                    == "Registry"):
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    found[(module, target.id)] = (call, tree)
    return found


def _builtins_of(call: ast.Call, tree: ast.Module) -> set[str]:
    """The modules a Registry(...) call lists as built-ins (a literal, or a module-level constant named there), and
    the modules of its `register_lazy(name, "module:attr")` targets in the same file."""
    out: set[str] = set()
    for kw in call.keywords:
        if kw.arg == "builtins":
            value = kw.value
            if isinstance(value, ast.Name):  # e.g. builtins=BUILTIN_FAMILIES
                value = next(n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
                    getattr(t, "id", None) == value.id for t in getattr(n, "targets", [getattr(n, "target", None)])))
            out |= set(ast.literal_eval(value))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "register_lazy" and len(node.args) == 2
                and isinstance(node.args[1], ast.Constant)):
            out.add(node.args[1].value.rpartition(":")[0])
    return out


def test_no_registry_imports_its_users():
    """A registry module (each extension point's, and every other module-level Registry found) imports none of its
    users: not a module listed in its built-ins or lazy targets, not a module that imports it (which registers into
    it), and nothing above its room's floor: the built-ins are loaded by module path on first lookup."""
    calls = _registry_calls()
    modules = set(EXTENSION_POINTS) | {m for m, _ in calls}
    importers: dict[str, set[str]] = defaultdict(set)
    parsed = {}
    for path, module, tree in _product_trees():
        parsed[module] = (path, list(_imports(tree, module, path.name == "__init__.py")))
        for _, target in parsed[module][1]:
            importers[target].add(module)
    bad = []
    for registry in sorted(modules):
        users = set(importers[registry])
        for (m, _), (call, tree) in calls.items():
            if m == registry:
                users |= _builtins_of(call, tree)
        package = _package(registry)
        if package not in REGISTRY_FLOORS:
            bad.append(f"{registry}: no floor in REGISTRY_FLOORS for its package {package} (add its room's)")
            continue
        allowed = REGISTRY_FLOORS[package] | REGISTRY_SHARED
        path, imports = parsed[registry]
        for line, target in sorted(set(imports)):
            if target.split(".")[0] not in PRODUCT or target == "mpo":
                continue
            where = f"{registry} -> {target} ({path.relative_to(ROOT)}:{line})"
            if target in users:
                bad.append(f"imports its user: {where}")
            elif _package(target) not in allowed and target not in REGISTRY_SHARED:
                bad.append(f"imports above its floor ({', '.join(sorted(allowed))}): {where}")
    assert not bad, "registries importing their users:\n" + "\n".join(bad)


def test_every_extension_point_is_a_registry():
    """The extension points (losses, advantage estimators, rewards, environments, model families, weight-sync
    transports) are each one mpo.registry.Registry, found where they are defined, with their built-ins."""
    import importlib

    from mpo.registry import Registry

    found = sorted(f"{m}:{n}" for m, n in _registry_calls())
    missing = [f"{m}:{n}" for m, n in EXTENSION_POINTS.items() if f"{m}:{n}" not in found]
    assert not missing, f"extension points that are not a Registry(...): {missing}; Registry objects found: {found}"
    for entry in found:
        module, _, name = entry.partition(":")
        registry = getattr(importlib.import_module(module), name)
        assert isinstance(registry, Registry), f"{entry} is a {type(registry).__name__}"
        if entry.partition(":")[0] in EXTENSION_POINTS:
            assert registry.names(), f"{entry} has no built-ins"


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
