"""Bounds on a model's own chat template: hostile input, run as a program at load and on every request.

A Jinja chat template comes from a model file anyone can publish. The sandbox (transformers' kind,
built in :mod:`ctxfold.tokens.templates.sandbox`) keeps it away from Python's internals; this module keeps it
from taking the process's time and memory, in two layers. It holds the bounds and the checks; the
sandbox wires them into a template's operators, calls, filters, loops and output.

**Every render is bounded** (:class:`RenderBudget`; :func:`ctxfold.tokens.templates.sandbox.bounded_environment`).
The operators that build big values (``*``, ``**``, ``+``, ``%``, and ``~``) and the calls and filters that do
(``center``, ``replace``, ``join``, ``format``, ...) are checked before they compute: no string over
:data:`MAX_VALUE_CHARS` characters, no list over :data:`MAX_VALUE_ITEMS` items, no integer over
:data:`MAX_INT_BITS` bits. A list, tuple or dict the template builds (a literal, an operator's or a
call's result) may not print as more than :data:`MAX_VALUE_CHARS` characters either, its parts counted
as often as they appear: comparing, sorting or printing one (C code that no check can interrupt) is
then bounded, where a list holding itself twice, forty levels deep, would print 2^40 leaves. Every
``{% for %}`` loop (recursive ones and filters' generators too) draws from one budget of
:data:`MAX_RENDER_ITERATIONS` iterations a render; a render stops past :data:`RENDER_TIMEOUT_S` seconds
(the clock is read at each loop iteration and each time its operations have built another MiB), past
:data:`MAX_OUTPUT_CHARS` characters of output (the render's, or one macro's, block's or ``{% set %}``'s),
and once the process has grown by :data:`MAX_RENDER_GROWTH_BYTES` during it. Going past any of these
raises :class:`ctxfold.tokens.templates.jinja.TemplateBoundsError` (a ``TemplateRenderError``) with one line;
so do a recursion without end and running out of memory. The budget is set by ``Template.render``, the
only way ctxfold renders.

**A template from a file is loaded in a child process first**: :mod:`ctxfold.tokens.templates.loader`.

What stays loose in process: a single operation the checks do not model can still allocate once before
the size check after it refuses the result (``split`` of a 16 MiB string into millions of pieces,
``tojson(ensure_ascii=True)`` escaping a large value six-fold: a few hundred MiB, briefly); one C-level
operation on values within the bounds (sorting two million items) runs to its end, seconds at most,
before the clock is read again. At load, the child process bounds these too.
"""

from __future__ import annotations

import os
import re
import string
import time
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence, ValuesView
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, NoReturn

from ctxfold.errors import TemplateBoundsError

# -- the bounds ---------------------------------------------------------------------------------------------
# Module attributes, read when used, so a deployment (or a test) can set them.

MAX_VALUE_CHARS = 16 * 2**20  # one string (or bytes) a template builds, in characters
MAX_VALUE_ITEMS = 2 * 2**20  # one list or tuple a template builds, in items (16 MiB of references)
# One integer: Python prints none over 4,300 digits (~14,300 bits) anyway; products of these stay fast.
MAX_INT_BITS = 65_536
MAX_RANGE_ITEMS = 100_000  # one range() (jinja2's own sandbox bound, kept with a plainer message)
MAX_OUTPUT_CHARS = 64 * 2**20  # the text of one render, or of one macro, block or {% set %} in it
MAX_RENDER_ITERATIONS = 4_000_000  # loop iterations of one render, all loops together
RENDER_TIMEOUT_S = 5.0  # one render's wall clock
MAX_RENDER_GROWTH_BYTES = 512 * 2**20  # how far the process may grow during one render
MAX_TEMPLATE_CHARS = 2**20  # a template's source (models ship a few KiB; the largest known, ~100 KiB)

# The process's size is read each time a render's operations have built this much more; the clock, each
# time they have built this much (work that builds little is bounded by the loop budget instead).
_MEMORY_CHECK_BYTES = 64 * 2**20
_CLOCK_CHECK_BYTES = 2**20


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _refuse(reason: str, what: str) -> NoReturn:
    raise TemplateBoundsError(what, reason=reason)


def _too_big(what: str) -> NoReturn:
    _refuse("size", what)


# -- the budget of one render -------------------------------------------------------------------------------

def _page_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 4096


_PAGE_BYTES = _page_bytes()


def _rss_bytes() -> int | None:
    """The process's resident memory now (Linux); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class RenderBudget:
    """What one render may still spend: loop iterations, wall clock (read at each loop iteration and
    each time its operations have built another MiB), and growth of the process (read from the system
    each time they have built another 64 MiB, so a render that builds little never reads it)."""

    __slots__ = ("_baseline_rss_bytes", "_next_clock_bytes", "_next_memory_bytes", "allocated_bytes",
                 "deadline_s", "iterations")

    def __init__(self) -> None:
        self.deadline_s = time.monotonic() + RENDER_TIMEOUT_S
        self.iterations = 0
        self.allocated_bytes = 0
        self._next_clock_bytes = _CLOCK_CHECK_BYTES
        self._next_memory_bytes = _MEMORY_CHECK_BYTES
        self._baseline_rss_bytes: int | None = None

    def iterate(self, n: int) -> None:
        self.iterations += n
        if self.iterations > MAX_RENDER_ITERATIONS:
            _refuse("iterations", f"its loops ran over {MAX_RENDER_ITERATIONS:,} iterations in one render")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline_s:
            _refuse("time", f"one render took over {RENDER_TIMEOUT_S:g} s")

    def charge(self, nbytes: int) -> None:
        self.allocated_bytes += nbytes
        if self.allocated_bytes < self._next_clock_bytes:
            return
        self._next_clock_bytes = self.allocated_bytes + _CLOCK_CHECK_BYTES
        self.check_time()
        if self.allocated_bytes < self._next_memory_bytes:
            return
        self._next_memory_bytes = self.allocated_bytes + _MEMORY_CHECK_BYTES
        rss = _rss_bytes()
        if rss is None:
            return
        if self._baseline_rss_bytes is None:
            self._baseline_rss_bytes = rss
        elif rss - self._baseline_rss_bytes > MAX_RENDER_GROWTH_BYTES:
            _refuse("memory", f"it needed over {_mib(MAX_RENDER_GROWTH_BYTES)} of memory in one render")


current_budget: ContextVar[RenderBudget | None] = ContextVar("ctxfold_render_budget", default=None)


def _budget() -> RenderBudget:
    # Outside a render (constant folding at compile time): a budget of its own, for the size checks.
    return current_budget.get() or RenderBudget()


def counted(iterable: Any) -> Any:
    """``iterable``, its items drawn from the render's loop budget: a sized one (a list, a string, a range,
    a dict) all at once and returned as it is, so ``loop.length``, ``loop.last`` and ``else`` see what they
    saw; any other (a filter's generator) item by item."""
    budget = _budget()
    try:
        n = len(iterable)
    except TypeError:
        return _each_counted(iterable, budget)
    budget.iterate(n)
    return iterable


def _each_counted(iterable: Iterable[Any], budget: RenderBudget) -> Iterator[Any]:
    for item in iterable:
        budget.iterate(1)
        yield item


# isinstance() takes a tuple of types faster than a union.
_TEXT = (str, bytes)
_SEQUENCE = (list, tuple)
_COLLECTION = (list, tuple, dict)
_CONTAINER = (list, tuple, set, frozenset, KeysView, ValuesView, ItemsView)


def checked(value: Any) -> Any:
    """``value``, a result of the template's operations, after its size is checked and charged."""
    if isinstance(value, _TEXT):
        n = len(value)
        if n > MAX_VALUE_CHARS:
            _too_big(f"it built a string of over {MAX_VALUE_CHARS:,} characters")
    elif isinstance(value, _COLLECTION):
        if len(value) > MAX_VALUE_ITEMS:
            _too_big(f"it built a list or mapping of over {MAX_VALUE_ITEMS:,} items")
        n = len(value) * 8  # its references
        _check_spread(value, "it built a list or mapping")
    elif isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            _refuse("size", f"it computed a number of over {MAX_INT_BITS:,} bits")
        return value
    elif getattr(type(value), "__next__", None) is not None:  # an iterator (a filter's generator)
        return _each_counted(value, _budget())
    else:
        return value
    budget = current_budget.get()
    if budget is not None:
        budget.charge(n)
    return value


# -- how big a value prints ------------------------------------------------------------------------------------

class _Over(Exception):
    """The walk of a value passed the bound: no need to walk the rest."""


@lru_cache(maxsize=1)
def _namespace_type() -> type[Any]:
    from jinja2.utils import Namespace

    return Namespace


def _children(value: Any) -> Iterable[Any] | None:
    if isinstance(value, Mapping):
        return [x for kv in value.items() for x in kv]
    if isinstance(value, _CONTAINER):
        return value
    if isinstance(value, _namespace_type()):
        attrs = object.__getattribute__(value, "_Namespace__attrs")
        return [x for kv in attrs.items() for x in kv]
    return None


def text_size(value: Any, indent: int = 0, limit: int | None = None) -> int:
    """An upper bound of the length of ``str(value)`` (or of its JSON, ``indent`` a level), counted past
    ``limit`` (default: :data:`MAX_VALUE_CHARS`) only as far as needed to know it is over. A list that holds
    one list twice prints it twice: the sizes add up so; the walk visits it once."""
    bound = MAX_VALUE_CHARS if limit is None else limit
    if isinstance(value, str | bytes):
        return len(value)
    if value is None or isinstance(value, int | float):
        return 64 if not isinstance(value, int) or isinstance(value, bool) else value.bit_length() // 3 + 2
    memo: dict[int, tuple[int, int, int]] = {}

    def walk(v: Any) -> tuple[int, int, int]:  # characters, values, indentation levels of all of them
        if isinstance(v, _TEXT):
            return len(v) + 2, 1, 0  # quotes
        if isinstance(v, int) and not isinstance(v, bool):
            return v.bit_length() * 30103 // 100000 + 2, 1, 0  # decimal digits and a sign
        children = _children(v)
        if children is None:
            return 64, 1, 0  # None, a float, an object: a short repr
        key = id(v)
        hit = memo.get(key)
        if hit is not None:
            return hit
        memo[key] = (5, 1, 0)  # a value inside itself prints as "[...]"
        chars, count, levels = 2, 1, 0
        for c in children:
            c_chars, c_count, c_levels = walk(c)
            chars, count, levels = chars + c_chars + 2, count + c_count, levels + c_levels + c_count
            if chars + count + indent * levels > bound:
                raise _Over
        memo[key] = (chars, count, levels)
        return chars, count, levels

    try:
        chars, count, levels = walk(value)
    except _Over:
        return bound + 1
    return chars + (count + indent * levels if indent else 0)


def _check_spread(value: Any, what: str) -> None:
    """A container the template built, no bigger than a value may be once its parts are counted as often as
    they appear: every comparison, sort, membership test or print of it is then bounded, though each
    runs in C with no check inside (two lists of two million references to two equal 16 MiB strings
    compare for hours)."""
    if text_size(value) > MAX_VALUE_CHARS:
        _too_big(f"{what} that prints as over {MAX_VALUE_CHARS:,} characters")


def _check_text(value: Any, what: str, indent: int = 0) -> None:
    if not isinstance(value, str) and text_size(value, indent) > MAX_VALUE_CHARS:
        _too_big(f"{what} would print a value of over {MAX_VALUE_CHARS:,} characters")


def finalize(value: Any) -> Any:
    """Every ``{{ ... }}`` value before it is printed: a container that prints as more than a value may
    hold (a list holding itself twice, forty levels deep) is refused before ``str()`` runs."""
    if type(value) is not str:
        _check_text(value, "an output expression")
    return value


# -- operators ---------------------------------------------------------------------------------------------------

def _check_int_args(what: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Sizes passed as numbers (widths, counts, lengths): none over what a value may hold."""
    for v in (*args, *kwargs.values()):
        if type(v) is int and v > MAX_VALUE_CHARS:
            _too_big(f"{what} was given a number over {MAX_VALUE_CHARS:,}")


def _check_power(left: Any, right: Any) -> None:
    if (type(left) is int and type(right) is int and right > 0 and abs(left) > 1
            and left.bit_length() * right > MAX_INT_BITS):
        _refuse("size", f"it would compute a power of over {MAX_INT_BITS:,} bits")


def _check_product(left: Any, right: Any) -> None:
    seq, n = (right, left) if isinstance(right, str | bytes | list | tuple) else (left, right)
    if isinstance(seq, str | bytes) and type(n) is int and len(seq) * n > MAX_VALUE_CHARS:
        _too_big(f"'*' would repeat a string to over {MAX_VALUE_CHARS:,} characters")
    elif isinstance(seq, list | tuple) and type(n) is int and len(seq) * n > MAX_VALUE_ITEMS:
        _too_big(f"'*' would repeat a list to over {MAX_VALUE_ITEMS:,} items")
    elif isinstance(seq, list | tuple) and type(n) is int and n > 1 and text_size(seq) * n > MAX_VALUE_CHARS:
        _too_big(f"'*' would repeat a list to one that prints as over {MAX_VALUE_CHARS:,} characters")
    elif isinstance(seq, int) and isinstance(n, int) and seq.bit_length() + n.bit_length() > MAX_INT_BITS:
        _refuse("size", f"it would compute a product of over {MAX_INT_BITS:,} bits")


def _check_sum(left: Any, right: Any) -> None:
    strings = isinstance(left, _TEXT) and isinstance(right, _TEXT)
    if strings and len(left) + len(right) > MAX_VALUE_CHARS:
        _too_big(f"'+' would build a string of over {MAX_VALUE_CHARS:,} characters")
    lists = isinstance(left, _SEQUENCE) and isinstance(right, _SEQUENCE)
    if lists and len(left) + len(right) > MAX_VALUE_ITEMS:
        _too_big(f"'+' would build a list of over {MAX_VALUE_ITEMS:,} items")
    if lists and text_size(left) + text_size(right) > MAX_VALUE_CHARS:
        _too_big(f"'+' would build a list that prints as over {MAX_VALUE_CHARS:,} characters")


# A printf-style conversion: its width and precision ("*": taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _format_values(args: Any) -> list[Any]:
    if isinstance(args, Mapping):
        return list(args.values())
    return list(args) if isinstance(args, tuple) else [args]


def _check_formatted(what: str, fmt: str, fields: int, widths: Sequence[str], values: Sequence[Any]) -> None:
    """A format string's result: its text, then each field's value (at most the largest one) or width."""
    size = len(fmt)
    for w in widths:
        if len(w) > 9 or int(w) > MAX_VALUE_CHARS:
            _too_big(f"{what} has a width over {MAX_VALUE_CHARS:,}")
        size += int(w)
    largest = max((text_size(v) for v in values), default=0)
    if size + fields * largest > MAX_VALUE_CHARS:
        _too_big(f"{what} would build a string of over {MAX_VALUE_CHARS:,} characters")


def _check_percent(fmt: str, args: Any) -> None:
    values = _format_values(args)
    fields, widths, star = 0, [], False
    for m in _PERCENT_SPEC.finditer(fmt):
        if m.group(3) == "%":
            continue
        fields += 1
        for w in m.group(1, 2):
            if w == "*":
                star = True
            elif w:
                widths.append(w)
    if star:
        _check_int_args("'%' formatting", values, {})
    _check_formatted("'%' formatting", fmt, fields, widths, values)


def _check_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """``fmt.format(*args, **kwargs)``: widths in its fields' specs, nested ones from the arguments."""
    fields, widths, nested = 0, [], False
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # not a format string: format() itself says so
    for _, field, spec, _ in parsed:
        if field is None:
            continue
        fields += 1
        nested = nested or "{" in (spec or "")
        widths += re.findall(r"\d+", spec or "")
    values = [*args, *kwargs.values()]
    if nested:
        _check_int_args("a format string", values, {})
    _check_formatted("a format string", fmt, fields, widths, values)


def call_binop(env: Any, context: Any, operator: str, left: Any, right: Any) -> Any:
    """The sandbox's hook for the operators it intercepts (its method, without a frame of its own)."""
    del context
    if operator == "+" and type(left) is str and type(right) is str:  # most of what templates compute
        n = len(left) + len(right)
        if n > MAX_VALUE_CHARS:
            _too_big(f"'+' would build a string of over {MAX_VALUE_CHARS:,} characters")
        budget = current_budget.get()
        if budget is not None:
            budget.charge(n)
        return left + right
    if operator == "**":
        _check_power(left, right)
    elif operator == "*":
        _check_product(left, right)
    elif operator == "+":
        _check_sum(left, right)
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)
    return checked(env.binop_table[operator](left, right))


def concat(operands: list[Any]) -> str:
    """``a ~ b ~ ...``, in place of jinja2's join of the operands' ``str()``."""
    size = 0
    for x in operands:
        size += text_size(x)
        if size > MAX_VALUE_CHARS:
            _too_big(f"'~' would build a string of over {MAX_VALUE_CHARS:,} characters")
    out: str = checked("".join(map(str, operands)))
    return out


def bounded_range(*args: int) -> range:
    try:
        rng = range(*args)
        n = len(rng)
    except OverflowError:
        n = MAX_RANGE_ITEMS + 1
    if n > MAX_RANGE_ITEMS:
        _refuse("iterations", f"it asked for a range of over {MAX_RANGE_ITEMS:,} numbers")
    return rng


def bounded_concat(chunks: Iterable[str]) -> str:
    """The text of a render (or of a macro, block, {% set %}), refused once over :data:`MAX_OUTPUT_CHARS`:
    chunks are references (a loop printing one string a million times holds it once) until joined."""
    parts: list[str] = []
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > MAX_OUTPUT_CHARS:
            _refuse("output", f"its output went over {_mib(MAX_OUTPUT_CHARS)}")
        parts.append(chunk)
    out = "".join(parts)
    _budget().charge(total)
    return out


# -- calls and filters --------------------------------------------------------------------------------------------

def _check_replace(s: str | bytes, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if len(args) < 2 or not isinstance(args[0], str | bytes) or not isinstance(args[1], str | bytes):
        return  # replace() itself refuses what it cannot take
    old, new = args[0], args[1]
    count = args[2] if len(args) > 2 else kwargs.get("count", -1)
    n = s.count(old) if old else len(s) + 1  # type: ignore[arg-type]  # same kind, or replace() refuses
    if type(count) is int and count >= 0:
        n = min(n, count)
    if len(s) + n * max(len(new) - len(old), 0) > MAX_VALUE_CHARS:
        _too_big(f"a replace would build a string of over {MAX_VALUE_CHARS:,} characters")


def _check_joined(sep: Any, items: Sequence[Any]) -> None:
    size = len(str(sep)) * max(len(items) - 1, 0)
    for x in items:
        size += text_size(x)
        if size > MAX_VALUE_CHARS:
            _too_big(f"a join would build a string of over {MAX_VALUE_CHARS:,} characters")


def precheck_method(obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """A call of a built-in type's method (``s.center(n)``, ``s.replace(a, b)``, ``sep.join(xs)``,
    ``fmt.format(...)``), checked before it runs; the arguments to call it with (a join's iterable, counted
    and listed)."""
    wrapped = getattr(obj, "__wrapped__", None)  # the sandbox's own wrapper of str.format and format_map
    if wrapped is not None and isinstance(getattr(wrapped, "__self__", None), str):
        if wrapped.__name__ == "format":
            _check_format(wrapped.__self__, args, kwargs)
        elif wrapped.__name__ == "format_map" and args and isinstance(args[0], Mapping):
            _check_format(wrapped.__self__, (), args[0])
        return args
    owner = getattr(obj, "__self__", None)
    if owner is None or not isinstance(owner, str | bytes | int | float | list | tuple | dict | set):
        return args
    name = getattr(obj, "__name__", "")
    _check_int_args(f"the {name} method", args, kwargs)
    if not isinstance(owner, str | bytes):
        return args
    if name == "replace":
        _check_replace(owner, args, kwargs)
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], list | tuple) else list(counted(args[0]))
        _check_joined(owner, items)
        args = (items, *args[1:])
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        tabs = owner.count("\t" if isinstance(owner, str) else b"\t")  # type: ignore[arg-type]
        if type(tab) is int and len(owner) + tabs * tab > MAX_VALUE_CHARS:
            _too_big(f"expandtabs would build a string of over {MAX_VALUE_CHARS:,} characters")
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((text_size(v) for v in args[0].values()), default=1)
        if len(owner) * longest > MAX_VALUE_CHARS:
            _too_big(f"translate would build a string of over {MAX_VALUE_CHARS:,} characters")
    return args


# Filters whose result is their input as text: a container input is measured first.
_STRINGIFYING = frozenset({
    "capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower", "pprint", "replace",
    "safe", "string", "striptags", "title", "tojson", "trim", "truncate", "upper", "urlencode", "urlize",
    "wordcount", "wordwrap", "xmlattr",
})


# Filters that can build more than their input: checked each their own way.
_GROWING = frozenset({"format", "replace", "indent", "wordwrap", "join", "sum", "batch", "urlize"})


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def precheck_filter(name: str, value: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A filter's call, checked before it runs; the value to call it with (a join's or sum's input,
    counted and listed)."""
    if args or kwargs:
        _check_int_args(f"the {name} filter", args, kwargs)
    if name in _STRINGIFYING and type(value) is not str:
        indent = _arg(args, kwargs, 1, "indent", None) if name == "tojson" else 1 if name == "pprint" else 0
        # Without an indent, JSON is no bigger than its value: the request's own data, or one the template
        # built (checked when built). Measured, every render's tools would be walked twice.
        if name != "tojson" or indent:
            _check_text(value, f"the {name} filter", len(indent) if isinstance(indent, str) else indent or 0)
    if name not in _GROWING:
        return value
    text = value if isinstance(value, str) else ""
    if name == "format" and text:
        _check_percent(text, (*args, *kwargs.values()))
    elif name == "replace" and text:
        _check_replace(text, args, kwargs)
    elif name == "indent" and text:
        width = _arg(args, kwargs, 0, "width", 4)
        per_line = len(width) if isinstance(width, str) else width if type(width) is int else 0
        if len(text) + (text.count("\n") + 1) * per_line > MAX_VALUE_CHARS:
            _too_big(f"indent would build a string of over {MAX_VALUE_CHARS:,} characters")
    elif name == "wordwrap" and text:
        wrap = _arg(args, kwargs, 2, "wrapstring", None)
        width = _arg(args, kwargs, 0, "width", 79)
        breaks = len(text) // max(width if type(width) is int else 79, 1) + text.count(" ") + text.count("\n") + 1
        if len(text) + breaks * len(str(wrap or "\n")) > MAX_VALUE_CHARS:
            _too_big(f"wordwrap would build a string of over {MAX_VALUE_CHARS:,} characters")
    elif name == "batch" and _arg(args, kwargs, 1, "fill_with", None) is not None:
        size = _arg(args, kwargs, 0, "linecount", 0)
        if type(size) is int and size > MAX_VALUE_ITEMS:  # the last batch is filled up to it
            _too_big(f"batch would fill a list to over {MAX_VALUE_ITEMS:,} items")
    elif name == "urlize" and text:
        per_link = sum(len(str(_arg(args, kwargs, i, k, None) or "")) for i, k in ((2, "target"), (3, "rel")))
        if (text.count(" ") + text.count("\n") + 1) * per_link > MAX_VALUE_CHARS:
            _too_big(f"urlize would build a string of over {MAX_VALUE_CHARS:,} characters")
    elif name in ("join", "sum") and not isinstance(value, str):
        items = value if isinstance(value, list | tuple) else list(counted(value))
        if name == "join" and _arg(args, kwargs, 1, "attribute", None) is None:
            _check_joined(_arg(args, kwargs, 0, "d", ""), items)
        elif name == "sum" and sum(len(x) for x in items if isinstance(x, list | tuple)) > MAX_VALUE_ITEMS:
            _too_big(f"sum would build a list of over {MAX_VALUE_ITEMS:,} items")
        return items
    return value


def lipsum(*args: Any, **kwargs: Any) -> Any:
    """jinja2's ``lipsum(n, html, min, max)`` global: ``n`` paragraphs of up to ``max`` words."""
    from jinja2.utils import generate_lorem_ipsum

    n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
    if type(n) is int and type(most) is int and n * max(most, 1) * 16 > MAX_VALUE_CHARS:
        _too_big(f"lipsum would build a string of over {MAX_VALUE_CHARS:,} characters")
    return generate_lorem_ipsum(*args, **kwargs)


__all__ = [
    "MAX_INT_BITS", "MAX_OUTPUT_CHARS", "MAX_RENDER_GROWTH_BYTES", "MAX_RENDER_ITERATIONS", "MAX_TEMPLATE_CHARS",
    "MAX_VALUE_CHARS", "MAX_VALUE_ITEMS", "RENDER_TIMEOUT_S", "RenderBudget", "text_size",
]
