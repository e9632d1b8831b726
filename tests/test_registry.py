"""The one registry type (mpo/registry.py): built-ins imported by module path on first lookup, lazy `module:attr`
built-ins, plug-ins from a user's file, one-line errors. Real modules and files, nothing faked."""

from __future__ import annotations

import sys

import pytest

from mpo.registry import Registry


def _module(tmp_path, monkeypatch, name: str, text: str) -> None:
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


def test_registry_imports_its_builtins_only_on_first_lookup(tmp_path, monkeypatch):
    registry: Registry = Registry("widget")
    monkeypatch.setattr(sys.modules[__name__], "REG", registry, raising=False)
    _module(tmp_path, monkeypatch, "reg_builtins_a",
            f"from {__name__} import REG\n@REG.register('blue')\ndef blue():\n    return 'blue'\n")
    registry._builtin_modules = ("reg_builtins_a",)
    assert "reg_builtins_a" not in sys.modules
    assert registry.get("blue")() == "blue" and "reg_builtins_a" in sys.modules
    assert registry.names() == ["blue"] and "blue" in registry


def test_registry_lazy_builtin_and_a_plugin_file_are_adapted_once(tmp_path, monkeypatch):
    calls = []

    def adapt(name, obj):
        calls.append(name)
        if not callable(obj):
            raise ValueError(f"widget {name!r}: not a function")
        return ("adapted", obj())

    registry = Registry("widget", adapt=adapt)
    _module(tmp_path, monkeypatch, "reg_lazy_b", "def red():\n    return 'red'\nNOT_A_FN = 3\n")
    registry.register_lazy("red", "reg_lazy_b:red")
    assert registry.get("red") == ("adapted", "red") and registry.get("red") == ("adapted", "red")
    plugin = tmp_path / "my_widget.py"
    plugin.write_text("def green():\n    return 'green'\n")
    name = f"{plugin}:green"
    assert registry.get(name) == ("adapted", "green") and registry.get(name) == ("adapted", "green")
    assert calls == ["red", name]
    assert registry.names() == ["red"]  # plug-ins are not listed as built-ins
    with pytest.raises(ValueError, match="not a function"):
        registry.get("reg_lazy_b:NOT_A_FN")


def test_registry_errors_are_one_line_and_name_what_is_known(tmp_path):
    registry = Registry("widget")
    registry.register("blue", 1)
    with pytest.raises(ValueError, match=r"^unknown widget 'bleu'; known widgets: blue, or 'module:attr'"):
        registry.get("bleu")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("blue", 2)
    with pytest.raises(ValueError, match="must not contain ':'"):
        registry.register("a:b", 3)
    with pytest.raises(ValueError, match=r"no Python file"):
        registry.get(f"{tmp_path}/missing.py:fn")


def test_registry_keeps_registration_order_and_unregisters(tmp_path, monkeypatch):
    registry = Registry("widget")
    for name in ("zeta", "alpha", "mid"):
        registry.register(name, name.upper())
    registry.register_lazy("lazy", "reg_never_imported:x")
    assert registry.names() == ["alpha", "lazy", "mid", "zeta"]
    assert registry.names(sort=False) == ["zeta", "alpha", "mid", "lazy"]
    registry.unregister("alpha")
    assert "alpha" not in registry and registry.names(sort=False) == ["zeta", "mid", "lazy"]
    registry.register("alpha", 1)  # the name is free again
    with pytest.raises(KeyError):
        registry.unregister("nope")


def test_registry_failed_lazy_import_and_failed_builtins_fail_again_the_same_way(tmp_path, monkeypatch):
    """A lazy built-in whose module fails to import stays registered (the next lookup gives the same error, not
    'unknown'); a built-in module that fails to import is retried on the next lookup instead of leaving the
    registry silently empty."""
    registry = Registry("widget")
    registry.register_lazy("broken", "reg_lazy_missing_c:Thing")
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot import module 'reg_lazy_missing_c'"):
            registry.get("broken")
    assert registry.names() == ["broken"]

    with_builtins = Registry("widget", builtins=("reg_builtins_missing_d",))
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError, match="reg_builtins_missing_d"):
            with_builtins.names()
