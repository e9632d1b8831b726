"""The one registry type behind every extension point (losses, advantage estimators, rewards, environments, weight-sync
transports, model families).

A registry maps names to entries. Its built-ins are listed by *module path* and imported on the first lookup (each
module registers its entries when imported), or named lazily as `module:attr` targets resolved on first use: so a
registry imports none of its users, and a light command that only lists names imports no torch. A name that is not
registered but has the form `module:attr` or `path/to/file.py:attr` is a user's plug-in (mpo.plugins resolves it,
with one set of one-line errors); the registry's `adapt` turns the object found into an entry (e.g. a bare loss
function into a LossSpec) and keeps it under that name, so the config check, the trainer and the workers see one.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

PLUGIN_FORMS = "'module:attr' / 'path/to/file.py:attr'"


class Registry(Generic[T]):
    """Names -> entries of one kind.

    Args:
        kind: what an entry is, in a user's words ("loss", "advantage estimator"): error messages start with it.
        builtins: modules imported on the first lookup; they register their entries with `register`.
        adapt: `(name, obj) -> entry` for a plug-in object and a lazy target; ValueError (one line) when `obj` is
            not a valid entry. Default: the object itself.
        plural: the kind's plural in messages (default kind + "s").
    """

    def __init__(self, kind: str, *, builtins: Iterable[str] = (), adapt: Callable[[str, Any], T] | None = None,
                 plural: str | None = None) -> None:
        self.kind = kind
        self.plural = plural or kind + "s"
        self._builtin_modules = tuple(builtins)
        self._adapt = adapt
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        # Built-in names in registration order (dict as an ordered set): some messages list them as registered.
        self._order: dict[str, None] = {}
        self._loaded = False
        # Built-in modules register while being imported, which may call back into this registry: re-entrant.
        self._lock = threading.RLock()

    # -- registering ---------------------------------------------------------------------------------------------
    def register(self, name: str, entry: T | None = None) -> Any:
        """`register(name, entry)` adds an entry; `@register(name)` adds the decorated object itself."""
        if entry is not None:
            self._add(name, entry)
            return entry

        def decorator(obj: Any) -> Any:
            self._add(name, obj)
            return obj

        return decorator

    def register_lazy(self, name: str, target: str) -> None:
        """A built-in named by its `module:attr`, imported (and adapted) on first use."""
        with self._lock:
            self._check_new(name)
            self._lazy[name] = target
            self._order[name] = None

    def _check_new(self, name: str) -> None:
        if ":" in name:
            raise ValueError(f"{self.kind} name {name!r} must not contain ':' (that form names a plug-in)")
        if name in self._entries or name in self._lazy:
            raise ValueError(f"{self.kind} {name!r} is already registered")

    def _add(self, name: str, entry: T) -> None:
        with self._lock:
            self._check_new(name)
            self._entries[name] = entry
            self._order[name] = None

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's temporary entry); KeyError if it is not registered."""
        with self._lock:
            if name not in self._entries and name not in self._lazy:
                raise KeyError(name)
            self._entries.pop(name, None)
            self._lazy.pop(name, None)
            self._order.pop(name, None)

    # -- looking up ----------------------------------------------------------------------------------------------
    def load_builtins(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True  # before importing: a built-in module that looks itself up must not recurse
            try:
                for path in self._builtin_modules:
                    importlib.import_module(path)
            except BaseException:
                self._loaded = False  # the next lookup raises the same error rather than seeing no built-ins
                raise

    def get(self, name: str) -> T:
        """The entry `name`: a built-in, or a plug-in `module:attr` / `path/to/file.py:attr` (loaded once); a
        ValueError naming the known ones otherwise."""
        self.load_builtins()
        with self._lock:
            if name in self._entries:
                return self._entries[name]
            if name in self._lazy:
                entry = self._resolve(name, self._lazy[name])
                del self._lazy[name]  # only once resolved: a failed import stays listed and fails the same way again
            elif isinstance(name, str) and ":" in name and all(name.rpartition(":")[::2]):
                entry = self._resolve(name, name)
            else:
                raise ValueError(f"unknown {self.kind} {name!r}; known {self.plural}: {', '.join(self.names())}, "
                                 f"or {PLUGIN_FORMS}")
            self._entries[name] = entry
            return entry

    def _resolve(self, name: str, target: str) -> T:
        from mpo.plugins import resolve_plugin

        obj = resolve_plugin(self.kind, name, target)
        return self._adapt(name, obj) if self._adapt is not None else obj

    def names(self, *, sort: bool = True) -> list[str]:
        """The built-in names (plug-ins loaded so far are not listed), sorted or in registration order."""
        self.load_builtins()
        return sorted(self._order) if sort else list(self._order)

    def __contains__(self, name: object) -> bool:
        self.load_builtins()
        return name in self._entries or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self, *, sort: bool = True) -> list[tuple[str, T]]:
        """Every built-in (resolved) with its entry, in name order or in registration order."""
        return [(name, self.get(name)) for name in self.names(sort=sort)]
