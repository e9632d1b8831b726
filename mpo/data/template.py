"""Chat templates rendered with bounds on time and size.

A chat template is a program shipped with the checkpoint. transformers renders it in jinja's immutable sandbox,
which stops attribute tricks but not `{% for i in range(99999) %}{% for j in range(99999) %}` (10^10 steps: rank 0
hangs) nor `{{ 'x' * 10**10 }}` (10 GB). `BoundedTemplate` compiles the same template with the same filters,
globals and extensions as transformers (taken from transformers' own compiled template), in a sandbox that:

  * checks a deadline at every call, attribute or item lookup, intercepted operator and output piece, and at every
    iteration of every loop of the compiled template (a backward jump in its code, seen through Python's
    `sys.monitoring`: a nested `for` over a string that calls, looks up and prints nothing is stopped too);
  * refuses `*`, `+` and `**` whose result would exceed `max_chars` (checked before the operation allocates), int
    arguments above `max_chars` to calls and filters (`'x'.ljust(n)`, `center(n)`, `indent(n)`), and widths above it
    in `%` and `str.format` (`'%9999999999s' % x`);
  * refuses a value over `max_chars` that a lookup, call or filter returns (`~` is not interceptable: a namespace
    string doubled in a loop is caught at its next lookup, at most twice over the bound);
  * stops once the output passes `max_chars`.

`render()` raises `TemplateLimit` for a bound and lets the template's own errors through; PromptEncoder turns both
into one DataError line naming the row. Nothing is evaluated while compiling (jinja folds constant expressions,
`{{ 'x' | center(10**10) }}` included, outside these checks): the optimizer is off and filters take the context.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from types import CodeType
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, pass_context


_NUMBER = re.compile(r"\d+")
log = logging.getLogger(__name__)


class TemplateLimit(Exception):
    """The template ran past its time or size bound (the message says which)."""


def _seq_len(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


class _LoopWatch:
    """Ticks the rendering thread's sandbox at every backward jump (a loop's next iteration) in templates' code.

    `sys.monitoring` (PEP 669) reports JUMP events only for the code objects it is told about (`watch`), so code
    outside templates runs at full speed and nothing else's tracing (a debugger, coverage) is displaced. It takes one
    of the tool ids Python leaves free (3 and 4); if both are taken, loops go unwatched and a warning says so once."""

    NAME = "mpo-template-bound"

    def __init__(self) -> None:
        self.active = threading.local()  # .env: the sandbox whose render() runs on this thread
        self.tool: int | None = None
        self._warned = False

    def _claim(self) -> int | None:
        monitoring = sys.monitoring
        for tool in (4, 3):
            if monitoring.get_tool(tool) == self.NAME:
                return tool
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, self.NAME)
                monitoring.register_callback(tool, monitoring.events.JUMP, self._on_jump)
                return tool
        return None

    def _on_jump(self, code: CodeType, source: int, target: int) -> None:
        env = getattr(self.active, "env", None)
        if env is not None and target < source:  # a backward jump: a loop goes round again
            env.tick()

    def watch(self, code: CodeType) -> None:
        """Report the jumps of `code` and of every code object nested in it (macros, blocks, generator expressions)."""
        if self.tool is None:
            self.tool = self._claim()
        if self.tool is None:
            if not self._warned:
                log.warning("chat templates: Python's monitoring tool ids 3 and 4 are taken; a template loop that "
                            "calls nothing is not bounded in time")
                self._warned = True
            return
        stack = [code]
        while stack:
            current = stack.pop()
            sys.monitoring.set_local_events(self.tool, current, sys.monitoring.events.JUMP)
            stack.extend(c for c in current.co_consts if isinstance(c, CodeType))


_LOOPS = _LoopWatch()


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state = threading.local()

    # -- bounds -------------------------------------------------------------------------------------------------------
    def arm(self, timeout_s: float, max_chars: int) -> None:
        self._state.deadline = time.monotonic() + timeout_s
        self._state.timeout_s = timeout_s
        self._state.max_chars = max_chars

    def tick(self) -> None:
        state = self._state
        if time.monotonic() > getattr(state, "deadline", float("inf")):
            raise TemplateLimit(f"took over {state.timeout_s:g} s")

    def check_size(self, n: int, what: str) -> None:
        limit = getattr(self._state, "max_chars", None)
        if limit is not None and n > limit:
            raise TemplateLimit(f"would build {what} of {n} items, over the limit of {limit}")

    def check_args(self, args, kwargs) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                self.check_size(abs(value), "a string or list")

    def check_widths(self, fmt) -> None:
        """Field widths in a %- or {}-format string (the digits in it: a coarse but safe reading)."""
        if isinstance(fmt, str):
            for digits in _NUMBER.findall(fmt):
                self.check_size(int(digits) if len(digits) < 20 else 1 << 64, "a formatted string")

    def checked(self, value):
        n = _seq_len(value)
        if n is not None:
            self.check_size(n, "a string or list")
        return value

    # -- sandbox hooks ------------------------------------------------------------------------------------------------
    def _compile(self, source: str, filename: str) -> CodeType:
        code = super()._compile(source, filename)
        _LOOPS.watch(code)
        return code

    def call_binop(self, context, operator: str, left, right):
        self.tick()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                n = _seq_len(seq)
                if n is not None and isinstance(count, int):
                    self.check_size(n * max(count, 0), "a string or list")
        elif operator == "+":
            a, b = _seq_len(left), _seq_len(right)
            if a is not None and b is not None:
                self.check_size(a + b, "a string or list")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            self.check_size(right * abs(left).bit_length() // 8, "a number of bytes")
        elif operator == "%":
            self.check_widths(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        __self.tick()
        __self.check_args(args, kwargs)
        if getattr(__obj, "__name__", None) in ("format", "format_map"):
            __self.check_widths(getattr(__obj, "__self__", None))
        return __self.checked(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        self.tick()
        return self.checked(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        self.tick()
        return self.checked(super().getitem(obj, argument))


def _bounded_filter(env: _BoundedSandbox, fn):
    """`fn` with the bounds checked. Marked pass_context so that the compiler never folds it into a constant (it calls
    constant filters while compiling, outside the bounds); the context is turned back into what `fn` asked for."""
    passes = _PassArg.from_obj(fn)

    @pass_context
    def wrapper(context, *args, **kwargs):
        env.tick()
        env.check_args(args[1:], kwargs)
        if passes is _PassArg.context:
            args = (context, *args)
        elif passes is _PassArg.eval_context:
            args = (context.eval_ctx, *args)
        elif passes is _PassArg.environment:
            args = (context.environment, *args)
        return env.checked(fn(*args, **kwargs))

    wrapper.__name__ = getattr(fn, "__name__", "filter")
    return wrapper


def _reference_environment(source: str):
    """transformers' environment for `source` (its filters, globals and extensions), or None if unavailable."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    return _compile_jinja_template(source).environment  # raises TemplateSyntaxError for a bad template


class BoundedTemplate:
    """`source` compiled once; `render(timeout_s=, max_chars=, **variables)` -> the text, within the bounds."""

    def __init__(self, source: str) -> None:
        import jinja2.ext

        reference = _reference_environment(source)
        if reference is None:
            env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                                  optimized=False)

            def raise_exception(message):
                raise jinja2.exceptions.TemplateError(message)

            env.globals["raise_exception"] = raise_exception
        else:
            env = _BoundedSandbox(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                                  extensions=[type(e) for e in reference.extensions.values()], optimized=False)
            env.filters.update(reference.filters)
            env.globals.update(reference.globals)
        env.filters.update({name: _bounded_filter(env, fn) for name, fn in env.filters.items()})
        self.env = env
        self.template = env.from_string(source)

    def render(self, *, timeout_s: float, max_chars: int, **variables) -> str:
        self.env.arm(timeout_s, max_chars)
        _LOOPS.active.env = self.env
        try:
            pieces, size = [], 0
            for piece in self.template.generate(**variables):
                size += len(piece)
                self.env.check_size(size, "an output")
                self.env.tick()
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _LOOPS.active.env = None
            self.env.arm(float("inf"), max_chars)
