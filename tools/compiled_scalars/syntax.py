"""What the compiled-scalar checker reads from source: findings, AST helpers, usage, pragmas.

Stdlib only; nothing of the checked code is imported (docs/compiled-scalar-checker.md).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

_FLOAT_TYPE_NAMES = frozenset({"float", "SupportsFloat", "Real", "Number"})
_TENSOR_TYPE_NAMES = frozenset({"Tensor", "Parameter"})
# A Python float has these attributes; any other attribute access suggests a tensor.
_FLOAT_ATTRS = frozenset(
    {"real", "imag", "conjugate", "is_integer", "hex", "fromhex", "as_integer_ratio"}
)
_CLAMP_FUNCS = frozenset(
    {
        "clamp",
        "clamp_",
        "clip",
        "clip_",
        "clamp_min",
        "clamp_min_",
        "clamp_max",
        "clamp_max_",
        "hardtanh",
        "hardtanh_",
    }
)
_BOUND_KEYWORDS = frozenset({"min", "max", "min_val", "max_val"})
_PRAGMA_MARK = re.compile(r"compiled-scalar\s*:")
_VALID_PRAGMA = re.compile(r"compiled-scalar\s*:\s*ok\s*\((?P<reason>.*)\)")
_PRAGMA_FORM = "'# compiled-scalar: ok (<reason>)'"

_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_ScopeNode = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda


class CheckError(Exception):
    """A file could not be checked (unreadable, undecodable, or not valid Python)."""


@dataclass(frozen=True, order=True)
class Finding:
    """One way a Python float can reach compiled code.

    Attributes:
        path: File the finding is in, as given or discovered.
        line: 1-based line of the offending parameter, argument, name or comment.
        function: Name of the compiled function (``<lambda>`` for lambdas, ``<module>`` for a
            pragma outside any function).
        parameter: The parameter, bound argument or captured name; ``None`` for pragma findings.
        reason: Why this counts as a float and how the function is compiled.
        kind: ``parameter``, ``call``, ``partial``, ``closure``, ``global`` or ``pragma``; selects
            the wording of :meth:`__str__`.
    """

    path: str
    line: int
    function: str
    parameter: str | None
    reason: str
    kind: str = "parameter"

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}: function '{self.function}'"
        what = {
            "parameter": f" parameter '{self.parameter}' can carry a Python float into "
            "compiled code",
            "call": f" parameter '{self.parameter}' receives a Python float here",
            "partial": f" argument '{self.parameter}' is baked in by functools.partial",
            "closure": f" captures '{self.parameter}' from an enclosing function",
            "global": f" reads module-level float '{self.parameter}', which changes",
            "pragma": ": invalid compiled-scalar pragma",
        }[self.kind]
        return f"{where}{what} ({self.reason})"


@dataclass
class _Report:
    """Everything one scan produced."""

    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    compiled: int = 0
    files: int = 0


@dataclass
class _Site:
    """One way a target gets compiled (a decorator or a compiling call)."""

    via: str
    pragma_lines: frozenset[int] = frozenset()
    skip_params: frozenset[str] = frozenset()


@dataclass
class _Param:
    """A parameter of a compiled function with its default, if any."""

    arg: ast.arg
    default: ast.expr | None
    variadic: bool = False


# ---------------------------------------------------------------------------------------------
# Small AST helpers


def _number_literal(node: ast.expr) -> bool:
    """True for an int or float literal (not a bool), optionally with a unary sign."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    )


def _float_literal(node: ast.expr) -> bool:
    """True for a float literal, optionally with a unary sign."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, float)


def _int_literal(node: ast.expr) -> bool:
    """True for an int literal (not a bool), optionally with a unary sign."""
    return _number_literal(node) and not _float_literal(node)


def _scalar_ref(node: ast.expr) -> str | None:
    """The name in ``p``, ``-p`` or ``+p``; ``None`` for anything else."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return node.id if isinstance(node, ast.Name) else None


def _type_names(node: ast.expr) -> set[str]:
    """Every name and attribute leaf in a type expression, string annotations included."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            try:
                names |= _type_names(ast.parse(sub.value, mode="eval").body)
            except SyntaxError:
                pass
    return names


def _is_float_type(node: ast.expr) -> bool:
    return bool(_type_names(node) & _FLOAT_TYPE_NAMES)


def _is_tensor_type(node: ast.expr) -> bool:
    names = _type_names(node)
    return bool(names & _TENSOR_TYPE_NAMES) and not names & _FLOAT_TYPE_NAMES


def _split(node: ast.expr, op: type) -> list[ast.expr]:
    """Operands of a chain of ``and`` / ``or`` (``op``), or ``[node]``."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, op):
        return [leaf for value in node.values for leaf in _split(value, op)]
    return [node]


def _isinstance_call(node: ast.expr) -> tuple[str, ast.expr] | None:
    """``(p, classes)`` for ``isinstance(p, classes)``."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
        and isinstance(node.args[0], ast.Name)
    ):
        return node.args[0].id, node.args[1]
    return None


def _negated(node: ast.expr) -> ast.expr | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return node.operand
    return None


def _asserted_names(cond: ast.expr) -> set[str]:
    """Parameters an ``assert cond`` proves are not floats."""
    names = set()
    for leaf in _split(cond, ast.And):
        inner = _negated(leaf)
        if inner is None:
            call = _isinstance_call(leaf)
            if call and _is_tensor_type(call[1]):
                names.add(call[0])
        else:
            call = _isinstance_call(inner)
            if call and _is_float_type(call[1]):
                names.add(call[0])
    return names


def _raised_names(cond: ast.expr) -> set[str]:
    """Parameters an ``if cond: raise`` rejects when they are floats."""
    names = set()
    for leaf in _split(cond, ast.Or):
        inner = _negated(leaf)
        if inner is None:
            call = _isinstance_call(leaf)
            if call and _is_float_type(call[1]):
                names.add(call[0])
        else:
            call = _isinstance_call(inner)
            if call and _is_tensor_type(call[1]):
                names.add(call[0])
    return names


def _guarded_params(fn: _FunctionNode) -> set[str]:
    """Parameters guarded by the leading ``assert`` / ``if ...: raise`` run of ``fn``."""
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    guarded: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.Assert):
            guarded |= _asserted_names(stmt.test)
        elif isinstance(stmt, ast.If) and not stmt.orelse and isinstance(stmt.body[-1], ast.Raise):
            guarded |= _raised_names(stmt.test)
        else:
            break
    return guarded


def _walk_scope(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Walks ``nodes`` without entering nested function, lambda or class bodies.

    The nested definitions themselves are yielded (their names bind in this scope).
    """
    stack = list(nodes)[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        stack.extend(list(ast.iter_child_nodes(node))[::-1])


def _scope_body(scope: _ScopeNode) -> list[ast.AST]:
    return [scope.body] if isinstance(scope, ast.Lambda) else list(scope.body)


def _all_params(fn: _FunctionNode | ast.Lambda) -> list[_Param]:
    """Every parameter of ``fn`` with its default, in signature order."""
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    params = [_Param(a, d) for a, d in zip(positional, [*defaults, *args.defaults])]
    if args.vararg:
        params.append(_Param(args.vararg, None, variadic=True))
    params += [_Param(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        params.append(_Param(args.kwarg, None, variadic=True))
    return params


def _bound_names(scope: _ScopeNode) -> dict[str, str]:
    """Names bound in ``scope`` mapped to how: ``param``, ``assign``, ``def`` or ``import``."""
    bound: dict[str, str] = {}
    if not isinstance(scope, ast.Module | ast.ClassDef):
        for param in _all_params(scope):
            bound[param.arg.arg] = "param"
    declared_outside: set[str] = set()
    for node in _walk_scope(_scope_body(scope)):
        if isinstance(node, ast.Global | ast.Nonlocal):
            declared_outside.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            bound.setdefault(node.id, "assign")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound[node.name] = "def"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound[(alias.asname or alias.name).split(".")[0]] = "import"
    for name in declared_outside:
        bound.pop(name, None)
    return bound


def _name_loads(scope: _FunctionNode | ast.Lambda) -> list[ast.Name]:
    """Every ``Name`` read in the body of ``scope``, nested scopes included."""
    loads = []
    for node in ast.walk(ast.Module(body=_scope_body(scope), type_ignores=[])):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads.append(node)
    return loads


# ---------------------------------------------------------------------------------------------
# Usage heuristics for unannotated parameters


class DottedNames(Protocol):
    """What the usage heuristics ask of the module checker: an expression's dotted name.

    A protocol rather than the checker's class, so this module stays below the checker.
    """

    def dotted(self, node: ast.AST) -> str | None:
        """``torch.nn.functional.relu`` for ``F.relu`` after ``import torch.nn.functional as F``."""


class _Usage:
    """How each parameter is used in a function body: scalar evidence and tensor evidence."""

    def __init__(self, body: Sequence[ast.AST], names: set[str], checker: DottedNames):
        self.tensor_like: set[str] = set()
        self.scalar: dict[str, str] = {}
        for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
            self._visit(node, names, checker)

    def _note(self, name: str | None, names: set[str], evidence: str) -> None:
        if name in names and name not in self.scalar:
            self.scalar[name] = evidence

    def _visit(self, node: ast.AST, names: set[str], checker: DottedNames) -> None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in names and node.attr not in _FLOAT_ATTRS:
                self.tensor_like.add(node.value.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            self.tensor_like.add(node.value.id)
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literal = next((op for op in operands if _number_literal(op)), None)
            if literal is not None:
                for op in operands:
                    self._note(
                        _scalar_ref(op),
                        names,
                        f"compared with {ast.unparse(literal)} at line {line}",
                    )
        elif isinstance(node, ast.BinOp):
            for this, other in ((node.left, node.right), (node.right, node.left)):
                if _number_literal(other):
                    self._note(
                        _scalar_ref(this),
                        names,
                        f"arithmetic with {ast.unparse(other)} at line {line}",
                    )
        elif isinstance(node, ast.Call):
            self._visit_call(node, names, checker, line)

    def _visit_call(self, node: ast.Call, names: set[str], checker: DottedNames, line: int) -> None:
        for kw in node.keywords:
            if kw.arg in _BOUND_KEYWORDS:
                self._note(_scalar_ref(kw.value), names, f"passed as {kw.arg}= at line {line}")
        func = node.func
        func_name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        dotted = checker.dotted(func) or ""
        if func_name in _CLAMP_FUNCS:
            # torch.clamp(x, lo, hi) / F.hardtanh(x, lo, hi) vs the method form x.clamp(lo, hi).
            function_form = isinstance(func, ast.Name) or dotted.startswith("torch.")
            for arg in node.args[1 if function_form else 0 :]:
                self._note(_scalar_ref(arg), names, f"passed to {func_name}() at line {line}")
        elif dotted == "float" or dotted.startswith("math."):
            for arg in node.args:
                self._note(_scalar_ref(arg), names, f"passed to {dotted}() at line {line}")


# ---------------------------------------------------------------------------------------------
# Pragmas


def _comments(source: str) -> dict[int, str]:
    """Comment text by line number."""
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string
    except (tokenize.TokenError, SyntaxError):  # pragma: no cover - ast.parse already passed
        for number, text in enumerate(source.splitlines(), start=1):
            if "#" in text:
                comments[number] = text[text.index("#") :]
    return comments


def _pragmas(source: str) -> tuple[set[int], dict[int, str]]:
    """Lines with a valid pragma, and malformed pragma comments by line."""
    valid: set[int] = set()
    malformed: dict[int, str] = {}
    if "compiled-scalar" not in source:
        return valid, malformed
    for number, text in _comments(source).items():
        if not _PRAGMA_MARK.search(text):
            continue
        match = _VALID_PRAGMA.search(text)
        if match and match.group("reason").strip():
            valid.add(number)
        else:
            malformed[number] = text.strip()
    return valid, malformed
