"""The compiler: a template expression's whitelisted AST -> closures over a scope of drawn values (never
eval/exec)."""

from __future__ import annotations

import ast
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar

from clozemath.data.gsm_symbolic.functions import FUNCTIONS, _BINARY, _COMPARE, _UNARY, _integer, _subscript
from clozemath.data.gsm_symbolic.values import POOLS, _Fault, _plain


class _Scope:
    """One draw: the variables bound so far and the random generator."""

    __slots__ = ("rng", "values")

    def __init__(self, values: dict[str, Any], rng: random.Random) -> None:
        self.values = values
        self.rng = rng


Run = Callable[[_Scope], Any]
_REFUSED_NAMES = {
    ast.Attribute: "attribute access", ast.Lambda: "a lambda", ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension", ast.DictComp: "a comprehension", ast.GeneratorExp: "a comprehension",
    ast.NamedExpr: "an assignment expression", ast.JoinedStr: "an f-string", ast.Starred: "unpacking",
}


@dataclass
class _Compiler:
    """Turns one expression's AST into a closure; refuses every node type outside the whitelist."""

    variables: frozenset[str]
    reads: set[str] = field(default_factory=set)
    random: bool = False
    """Whether it calls a function that draws (`sample`, ...)."""

    def compile(self, node: ast.AST) -> tuple[Run, bool]:
        """The closure and whether it is constant (reads no variable, draws nothing): constants fold right away."""
        handler = self._HANDLERS.get(type(node))
        if handler is None:
            refused = _REFUSED_NAMES.get(type(node), f"syntax '{type(node).__name__}'")
            raise _Fault(f"{refused} is not allowed")
        run, constant = handler(self, node)
        if constant:
            value = run(_Scope({}, random.Random(0)))
            return (lambda scope: value), True
        return run, False

    def _many(self, nodes: Iterable[ast.AST]) -> tuple[list[Run], bool]:
        compiled = [self.compile(n) for n in nodes]
        return [run for run, _ in compiled], all(constant for _, constant in compiled)

    def _constant(self, node: ast.Constant) -> tuple[Run, bool]:
        value = node.value
        if isinstance(value, float):
            value = _plain(Fraction(repr(value)))
        elif not isinstance(value, (int, str)):
            raise _Fault(f"the constant {value!r} is not allowed")
        return (lambda scope: value), True

    def _name(self, node: ast.Name) -> tuple[Run, bool]:
        name = node.id
        if name in self.variables:
            self.reads.add(name)
            return (lambda scope: scope.values[name]), False
        if name in POOLS:
            pool = POOLS[name]
            return (lambda scope: pool), True
        if name in FUNCTIONS:
            raise _Fault(f"the function '{name}' is used without a call")
        raise _Fault(f"undefined name '{name}'")

    def _call(self, node: ast.Call) -> tuple[Run, bool]:
        name = _dotted_name(node.func)
        if name not in FUNCTIONS:
            raise _Fault(f"call of '{name or ast.unparse(node.func)}', which is not an allowed function")
        if node.keywords:
            raise _Fault(f"keyword arguments to '{name}' are not allowed")
        builtin = FUNCTIONS[name]
        args, constant = self._many(node.args)
        function = builtin.run
        if builtin.random:
            self.random = True
            return (lambda scope: function(scope.rng, *[a(scope) for a in args])), False
        return (lambda scope: function(*[a(scope) for a in args])), constant

    def _binary(self, node: ast.BinOp) -> tuple[Run, bool]:
        apply = _BINARY.get(type(node.op))
        if apply is None:
            raise _Fault(f"the operator '{type(node.op).__name__}' is not allowed")
        (left, right), constant = self._many((node.left, node.right))
        return (lambda scope: apply(left(scope), right(scope))), constant

    def _unary(self, node: ast.UnaryOp) -> tuple[Run, bool]:
        apply = _UNARY.get(type(node.op))
        if apply is None:
            raise _Fault(f"the operator '{type(node.op).__name__}' is not allowed")
        operand, constant = self.compile(node.operand)
        return (lambda scope: apply(operand(scope))), constant

    def _boolean(self, node: ast.BoolOp) -> tuple[Run, bool]:
        values, constant = self._many(node.values)
        if isinstance(node.op, ast.And):
            def run(scope: _Scope) -> Any:
                result = True
                for value in values:
                    result = value(scope)
                    if not result:
                        return result
                return result
        else:
            def run(scope: _Scope) -> Any:
                result = False
                for value in values:
                    result = value(scope)
                    if result:
                        return result
                return result
        return run, constant

    def _compare(self, node: ast.Compare) -> tuple[Run, bool]:
        tests = []
        for op in node.ops:
            if type(op) not in _COMPARE:
                raise _Fault(f"the comparison '{type(op).__name__}' is not allowed")
            tests.append(_COMPARE[type(op)])
        (first, *others), constant = self._many((node.left, *node.comparators))

        def run(scope: _Scope) -> bool:
            left = first(scope)
            for test, other in zip(tests, others, strict=True):
                right = other(scope)
                if not test(left, right):
                    return False
                left = right
            return True

        return run, constant

    def _conditional(self, node: ast.IfExp) -> tuple[Run, bool]:
        (test, then, otherwise), constant = self._many((node.test, node.body, node.orelse))
        return (lambda scope: then(scope) if test(scope) else otherwise(scope)), constant

    def _list_of(self, node: ast.List) -> tuple[Run, bool]:
        items, constant = self._many(node.elts)
        return (lambda scope: [item(scope) for item in items]), constant

    def _tuple_of(self, node: ast.Tuple) -> tuple[Run, bool]:
        items, constant = self._many(node.elts)
        return (lambda scope: tuple(item(scope) for item in items)), constant

    def _item(self, node: ast.Subscript) -> tuple[Run, bool]:
        (container, index), constant = self._many((node.value, node.slice))
        return (lambda scope: _subscript(container(scope), index(scope))), constant

    def _slice(self, node: ast.Slice) -> tuple[Run, bool]:
        parts = [node.lower, node.upper, node.step]
        runs, constant = self._many(p for p in parts if p is not None)
        bounds = iter(runs)
        slots = [next(bounds) if p is not None else None for p in parts]

        def run(scope: _Scope) -> slice:
            return slice(*(None if s is None else _integer(s(scope), "a slice bound") for s in slots))

        return run, constant

    _HANDLERS: ClassVar[dict[type[ast.AST], Callable[[_Compiler, Any], tuple[Run, bool]]]] = {
        ast.Constant: _constant, ast.Name: _name, ast.Call: _call, ast.BinOp: _binary, ast.UnaryOp: _unary,
        ast.BoolOp: _boolean, ast.Compare: _compare, ast.IfExp: _conditional, ast.List: _list_of,
        ast.Tuple: _tuple_of, ast.Subscript: _item, ast.Slice: _slice,
    }
    """The whitelist: every node type an expression may hold, and how it compiles."""


def _dotted_name(node: ast.AST) -> str | None:
    """`np.random.randint` for the attribute chain np -> random -> randint; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None
