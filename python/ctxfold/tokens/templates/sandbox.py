"""The sandbox a model's own chat template runs in: transformers' environment, with the bounds wired in.

:func:`compile_template` builds what transformers builds (``ImmutableSandboxedEnvironment`` with
``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension and the ``{% generation %}`` tag,
its ``tojson`` filter, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``), on a
sandbox whose operators, calls, filters, loops, literals and output go through the checks of
:mod:`ctxfold.tokens.templates.guard` (:func:`bounded_environment`, :func:`compile_bounded`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

from ctxfold.errors import ConfigError
from ctxfold.tokens.templates.guard import (
    RenderBudget,
    bounded_concat,
    bounded_range,
    call_binop,
    checked,
    concat,
    counted,
    current_budget,
    finalize,
    lipsum,
    precheck_filter,
    precheck_method,
)

# Filters named with a space: no template can write them, so none can shadow or call them.
_LOOP_FILTER = "ctxfold loop"
_CONCAT_FILTER = "ctxfold concat"
_LITERAL_FILTER = "ctxfold literal"


# -- the environment, as transformers builds it ------------------------------------------------------------

@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    """``source`` compiled as transformers compiles a chat template, its renders bounded (shared, cached)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.parser
        import jinja2.utils
    except ImportError:
        raise ConfigError("a model's own chat template needs jinja2: pip install 'ctxfold[templates]'") from None

    class GenerationTag(jinja2.ext.Extension):
        # transformers marks assistant text with {% generation %}...{% endgeneration %}; rendering is
        # unchanged by it.
        tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it so

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # transformers' filter: no HTML escaping (Jinja's own escapes <, >, &, ').
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Attributes that start with "_" are refused, as transformers does (no way to CPython internals).
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    # transformers' ImmutableSandboxedEnvironment, with bounds on what one render may spend.
    env = bounded_environment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return compile_bounded(env, source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template does not parse: {e.message} (line {e.lineno})") from None
    except RecursionError:
        raise ConfigError("the chat template does not parse: it nests deeper than Python can follow") from None



# -- the bounds, wired in -----------------------------------------------------------------------------------

def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    # A filter that takes the context (or eval context, or environment) gets it first, then its value.
    lead = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    @wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > lead:
            value = precheck_filter(name, args[lead], args[lead + 1:], kwargs)
            args = (*args[:lead], value, *args[lead + 1:])
        return checked(f(*args, **kwargs))

    bounded.ctxfold_bounded = True  # type: ignore[attr-defined]
    return bounded


def _literal(value: Any) -> Any:
    """A list, tuple or dict literal (``[a, b]``), checked as any value the template builds."""
    return checked(value)


def _loop_filter(context: Any, iterable: Any) -> Any:
    del context  # taken only so that jinja2 never calls it at compile time (constant folding)
    return counted(iterable)


# -- the environment ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _environment_class() -> type[Any]:
    import jinja2
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedTemplate(jinja2.Template):
        def render(self, *args: Any, **kwargs: Any) -> str:
            token = current_budget.set(RenderBudget())  # every render its own budget
            try:
                return super().render(*args, **kwargs)
            finally:
                current_budget.reset(token)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        template_class = BoundedTemplate
        concat = staticmethod(bounded_concat)  # every render's, macro's, block's and {% set %}'s text

        def __init__(self, **options: Any) -> None:
            super().__init__(finalize=finalize, **options)
            self.globals["range"] = bounded_range
            self.globals["lipsum"] = lipsum
            self.filters[_LOOP_FILTER] = jinja2.pass_context(_loop_filter)
            self.filters[_CONCAT_FILTER] = concat
            self.filters[_LITERAL_FILTER] = _literal

        call_binop = call_binop

        def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
            if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive loop
                args = (counted(args[0]), *args[1:])
            args = precheck_method(obj, args, kwargs)
            return checked(super().call(context, obj, *args, **kwargs))

    return BoundedSandbox


def bounded_environment(**options: Any) -> Any:
    """A sandbox as transformers builds one (``ImmutableSandboxedEnvironment`` with ``options``) whose
    renders are bounded as this module says. Compile with :func:`compile_bounded`, after adding filters."""
    return _environment_class()(**options)


def compile_bounded(env: Any, source: str) -> Any:
    """``source`` compiled in ``env`` (from :func:`bounded_environment`): its filters bounded, every
    ``{% for %}`` drawing from the render's loop budget, every ``~`` checked. Raises jinja2's
    ``TemplateSyntaxError`` as ``env.from_string`` does."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    for name, f in list(env.filters.items()):
        if name not in (_LOOP_FILTER, _CONCAT_FILTER, _LITERAL_FILTER) and not getattr(f, "ctxfold_bounded", False):
            env.filters[name] = _bounded_filter(name, f)

    class Bound(NodeTransformer):
        def visit_For(self, node: nodes.For) -> nodes.Node:
            self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
            return node

        def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
            self.generic_visit(node)
            return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT_FILTER, [], [], None, None,
                                lineno=node.lineno)

        def visit_List(self, node: nodes.List) -> nodes.Node:
            return literal(node)

        def visit_Dict(self, node: nodes.Dict) -> nodes.Node:
            return literal(node)

        def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
            # A tuple assigned to ({% for a, b in ... %}, {% set a, b = ... %}) is no value.
            return literal(node) if node.ctx == "load" else self.generic_visit(node)

    def literal(node: nodes.Expr) -> nodes.Node:
        Bound().generic_visit(node)
        return nodes.Filter(node, _LITERAL_FILTER, [], [], None, None, lineno=node.lineno)

    tree = env.parse(source)
    Bound().visit(tree)
    tree.set_environment(env)
    return env.from_string(tree)


__all__ = ["bounded_environment", "compile_bounded", "compile_template"]
