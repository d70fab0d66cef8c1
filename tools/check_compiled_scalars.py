#!/usr/bin/env python3
"""Static check: no Python float may enter a compiled function unguarded.

Why
---
A Python float passed to a ``torch.compile``d function is first specialized, and after its value
changes it is traced as a dynamic scalar. Some uses of that scalar (``clamp_min``/``clamp_max``)
are burned into the compiled artifact with the current value, and the AOTAutograd cache, whose key
does not include the value, then serves that artifact for later values: the compiled function
silently computes with a stale constant. Floats baked into a ``functools.partial``, a closure or a
module global go stale the same way, and stale artifacts can leak across processes through the
on-disk Inductor cache. Project rule (design principle 2): a value that may change between calls
enters compiled code as a tensor (a 0-d float32 tensor on the input's device), never as a Python
float. See docs/compile-safety.md for the full story and the recipe.

This checker enforces the rule statically with :mod:`ast` (stdlib only, nothing is imported from
the checked code). ``python tools/check_compiled_scalars.py [paths...] [--quiet]`` scans the given
files and directories (default: the repository's ``mcore_activations/`` and ``megatron/``),
prints one line per finding, ``path:line: function 'name' parameter 'p' ... (reason)``, and a
one-line summary. Exit status: 0 when clean, 1 when there are findings, 2 when a path does not
exist or a file cannot be read or parsed (the message names the file, line and column; the other
files are still checked). ``--quiet`` drops the summary line.

Compiled functions
------------------
- A ``def`` decorated with ``@torch.compile``, ``@torch.compile(...)``, ``@jit_fuser`` (any name
  or attribute ending in ``jit_fuser``, e.g. ``megatron.core.jit.jit_fuser``),
  ``@torch.jit.script``, ``@torch._dynamo.optimize(...)``, ``@functools.partial(torch.compile,
  ...)``, or any import alias of these (``from torch import compile as tc``) or module-level alias
  (``fuse = torch.compile``).
- A function wrapped by a call anywhere in the module: ``torch.compile(fn, ...)``,
  ``jit_fuser(fn)``, ``torch.compile(mode=...)(fn)``, ``torch.jit.script(fn)``, where ``fn`` is a
  ``def`` of the same module (resolved by name, innermost enclosing scope first) or
  ``self.method``/``cls.method`` of the enclosing class. Functions imported from elsewhere cannot
  be seen and are skipped.
- ``torch.compile(functools.partial(fn, ...))``: every bound argument except a ``str``/``bytes``/
  ``bool``/``int``/``None`` literal is a finding (the bound value is baked into the compiled
  code); the parameters left free are checked like any other compiled ``def``.
- ``torch.compile(lambda ...: ...)``: the lambda's parameters are checked, and every variable it
  captures from an enclosing function is a finding. The same capture rule applies to compiled
  ``def`` s nested in another function (a per-value closure goes stale like a partial).

When a parameter can carry a Python float
-----------------------------------------
- Its annotation mentions ``float``, ``SupportsFloat``, ``Real`` or ``Number`` anywhere:
  ``float``, ``Optional[float]``, ``float | None``, ``Union[int, float]``, ``typing.SupportsFloat``,
  ``numbers.Real``, ``tuple[float, float]``, string annotations included.
- Its default is a float literal (``0.0``, ``-1.5``), whatever the annotation; or an int literal
  (``linear_offset=0``) when it has no annotation (an ``int``-annotated default is fine: ints are
  not subject to the bug).
- It is unannotated, shows no tensor-like use, and is used as a scalar: compared with a number
  literal (``p > 0``); passed (as ``p`` or ``-p``) as ``min=``/``max=``/``min_val=``/``max_val=``
  of any call, or positionally as a bound of ``clamp``/``clamp_``/``clip``/``clamp_min``/
  ``clamp_max``/``hardtanh`` (method form ``x.clamp(-p, p)`` and function form
  ``torch.clamp(x, -p, p)``); in arithmetic whose other operand is a number literal (``p * 0.5``);
  in ``float(p)``; as an argument of ``math.*``. Tensor-like use means any attribute other than a
  float's own (``p.dtype``, ``p.shape``, ``p.to(...)``, ``p.size()``) or a subscript ``p[...]``.
- Annotated ``torch.Tensor``/``Tensor``/``Parameter`` (and any other non-float annotation) is
  fine, unless the default is a float literal. ``self``/``cls`` of methods and unannotated
  ``*args``/``**kwargs`` are not checked.
- The same module calls the compiled function (by its name, or by the name a
  ``name = torch.compile(fn)`` assignment gives it) with a float literal or ``float(...)`` for
  that parameter: reported at the call line.
- A compiled function reads a module-level name that is assigned a float literal (or annotated
  ``float``) at module level and assigned again elsewhere in the module (a second module-level
  assignment, an augmented assignment, or an assignment in a function declaring it ``global``).

Guards (the exact forms recognized)
-----------------------------------
1. Pragma comment ``# compiled-scalar: ok (<reason>)`` on the ``def`` line, on a decorator line,
   or on any line of the signature, suppresses every finding of that function. For call forms
   (``torch.compile(fn)``, partials, lambdas) the pragma may also sit on any line of the compiling
   call; it then suppresses the findings of that call only. The reason, inside the parentheses,
   must be non-empty. Any comment containing ``compiled-scalar:`` that is not of this form
   (``# compiled-scalar: ok`` with no reason, ``# compiled-scalar: ok ()``, a misspelled verb)
   is itself a finding and suppresses nothing.
2. Leading guard statements. After the docstring, the leading run of ``assert`` statements and of
   ``if <cond>: ... raise ...`` statements (the ``if`` body ends with ``raise``, no ``else``) is
   scanned; a later statement ends the run. A parameter ``p`` is guarded when that run contains:

   - ``assert isinstance(p, torch.Tensor)`` (or ``Tensor``, ``nn.Parameter``, a tuple of those),
     alone or as one operand of an ``and`` chain; a message after the comma is allowed;
   - ``assert not isinstance(p, float)`` (``float`` may be in a tuple, e.g. ``(int, float)``),
     alone or in an ``and`` chain;
   - ``if isinstance(p, float): raise ...`` (tuple allowed), alone or as an operand of an ``or``;
   - ``if not isinstance(p, torch.Tensor): raise ...``, alone or as an operand of an ``or``.

   A guarded parameter gets no finding at its definition or at call sites.

Limits
------
The check is per module and syntactic. It cannot see a function compiled in another module
(``torch.compile(imported_fn)``), a callable built at run time (``torch.compile(make_kernel(v))``,
``torch.compile(some_partial_variable)``), floats read through ``self`` attributes, or a float
hidden behind an annotation such as ``Any``. Code built that way needs review, or a guard inside
the function it compiles.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import sys
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CheckError", "Finding", "check_paths", "check_source", "main"]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = (REPO_ROOT / "mcore_activations", REPO_ROOT / "megatron")

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


class _Usage:
    """How each parameter is used in a function body: scalar evidence and tensor evidence."""

    def __init__(self, body: Sequence[ast.AST], names: set[str], checker: _ModuleChecker):
        self.tensor_like: set[str] = set()
        self.scalar: dict[str, str] = {}
        for node in ast.walk(ast.Module(body=list(body), type_ignores=[])):
            self._visit(node, names, checker)

    def _note(self, name: str | None, names: set[str], evidence: str) -> None:
        if name in names and name not in self.scalar:
            self.scalar[name] = evidence

    def _visit(self, node: ast.AST, names: set[str], checker: _ModuleChecker) -> None:
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

    def _visit_call(
        self, node: ast.Call, names: set[str], checker: _ModuleChecker, line: int
    ) -> None:
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


# ---------------------------------------------------------------------------------------------
# The per-module checker


class _ModuleChecker:
    """Finds compiled functions in one parsed module and checks them."""

    def __init__(self, tree: ast.Module, source: str, path: str):
        self.tree = tree
        self.path = path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases: dict[str, str] = {}
        self.compiler_aliases: dict[str, str] = {}
        self._collect_aliases()
        self.pragma_lines, self.bad_pragmas = _pragmas(source)
        self.mutable_floats = self._mutable_float_globals()
        self.findings: list[Finding] = []
        self.targets: set[ast.AST] = set()
        # Compiled defs a call in this module may reach by name, with how they are compiled.
        self.callable_names: dict[str, tuple[_FunctionNode, _Site]] = {}
        self.flagged_params: set[tuple[ast.AST, str]] = set()
        self._bound_cache: dict[ast.AST, dict[str, str]] = {}

    # -- names ---------------------------------------------------------------------------------

    def _collect_aliases(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                for alias in node.names:
                    if alias.name != "*":
                        sep = "" if module.endswith(".") or not module else "."
                        self.aliases[alias.asname or alias.name] = f"{module}{sep}{alias.name}"
        for node in self.tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                label = self.compiler_label(node.value)
                if label:
                    self.compiler_aliases[node.targets[0].id] = label

    def dotted(self, node: ast.AST) -> str | None:
        """``torch.nn.functional.relu`` for ``F.relu`` after ``import torch.nn.functional as F``."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def compiler_label(self, node: ast.AST) -> str | None:
        """How ``node`` compiles a function, if it is a compiler (decorator or wrapping callee)."""
        if isinstance(node, ast.Call):
            func = self.dotted(node.func)
            if func == "torch.compile" and not node.args:
                return "torch.compile(...)"
            if func == "torch._dynamo.optimize":
                return "torch._dynamo.optimize(...)"
            if func == "functools.partial" and node.args:
                inner = self.compiler_label(node.args[0])
                return f"functools.partial({inner}, ...)" if inner else None
            return None
        if isinstance(node, ast.Name) and node.id in self.compiler_aliases:
            return self.compiler_aliases[node.id]
        dotted = self.dotted(node)
        if dotted in ("torch.compile", "torch.jit.script"):
            return dotted
        if dotted and (dotted == "jit_fuser" or dotted.endswith(".jit_fuser")):
            return "jit_fuser"
        return None

    def _enclosing(self, node: ast.AST, kinds: tuple[type, ...]) -> ast.AST | None:
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, kinds):
            parent = self.parents.get(parent)
        return parent

    def _scopes(self, node: ast.AST) -> list[_ScopeNode]:
        """Enclosing scopes of ``node``, innermost first (a class only when directly inside)."""
        scopes = []
        parent = self.parents.get(node)
        while parent is not None:
            if isinstance(parent, _ScopeNode):
                if not isinstance(parent, ast.ClassDef) or not scopes:
                    scopes.append(parent)
            parent = self.parents.get(parent)
        return scopes

    def _bound(self, scope: _ScopeNode) -> dict[str, str]:
        """Cached :func:`_bound_names`."""
        if scope not in self._bound_cache:
            self._bound_cache[scope] = _bound_names(scope)
        return self._bound_cache[scope]

    def _is_method(self, fn: _FunctionNode) -> bool:
        if not isinstance(self.parents.get(fn), ast.ClassDef):
            return False
        return not any(self.dotted(d) == "staticmethod" for d in fn.decorator_list)

    def _resolve_def(self, node: ast.expr, at: ast.AST) -> list[_FunctionNode]:
        """The defs a name (or ``self.name``) refers to at ``at``."""
        if isinstance(node, ast.Name):
            for scope in self._scopes(at):
                defs = [
                    sub
                    for sub in _walk_scope(_scope_body(scope))
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef)
                    and sub.name == node.id
                ]
                if defs:
                    return defs
            return []
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            cls = self._enclosing(at, (ast.ClassDef,))
            if isinstance(cls, ast.ClassDef):
                return [
                    sub
                    for sub in cls.body
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef)
                    and sub.name == node.attr
                ]
        return []

    # -- module-level floats that change ---------------------------------------------------------

    def _mutable_float_globals(self) -> dict[str, int]:
        """Module-level float names assigned more than once, mapped to a reassignment line."""
        stores: dict[str, list[int]] = {}
        floats: set[str] = set()
        for node in _walk_scope(self.tree.body):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                is_float = _float_literal(node.value) or (
                    isinstance(node, ast.AnnAssign) and _is_float_type(node.annotation)
                )
                for target in targets:
                    if isinstance(target, ast.Name) and is_float:
                        floats.add(target.id)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                stores.setdefault(node.id, []).append(node.lineno)
        if not floats:
            return {}
        for fn in ast.walk(self.tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            declared = {
                name
                for node in _walk_scope(fn.body)
                if isinstance(node, ast.Global)
                for name in node.names
            }
            for node in _walk_scope(fn.body):
                if (
                    isinstance(node, ast.Name)
                    and isinstance(node.ctx, ast.Store)
                    and node.id in declared
                ):
                    stores.setdefault(node.id, []).append(node.lineno)
        return {name: sorted(stores[name])[1] for name in floats if len(stores.get(name, [])) > 1}

    # -- findings ------------------------------------------------------------------------------

    def _def_pragma_lines(self, fn: _FunctionNode) -> set[int]:
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        last = max(fn.lineno, fn.body[0].lineno - 1)
        return set(range(first, last + 1))

    def _suppressed(self, fn: ast.AST | None, site: _Site, line: int | None = None) -> bool:
        lines = set(site.pragma_lines)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            lines |= self._def_pragma_lines(fn)
        if line is not None:
            lines.add(line)
        return bool(lines & self.pragma_lines)

    def _add(self, line: int, function: str, parameter: str | None, reason: str, kind: str):
        self.findings.append(Finding(self.path, line, function, parameter, reason, kind))

    def _float_reason(self, param: _Param, usage: _Usage) -> str | None:
        ann, default, name = param.arg.annotation, param.default, param.arg.arg
        if ann is not None and _is_float_type(ann):
            text = ann.value if isinstance(ann, ast.Constant) else ast.unparse(ann)
            return f"annotated '{text}'"
        if default is not None and _float_literal(default):
            return f"float default {ast.unparse(default)}"
        if param.variadic:
            return None
        if ann is None and default is not None and _int_literal(default):
            return f"unannotated with numeric default {ast.unparse(default)}"
        if ann is None and name not in usage.tensor_like and name in usage.scalar:
            return f"unannotated and used as a scalar: {usage.scalar[name]}"
        return None

    def check_function(self, fn: _FunctionNode | ast.Lambda, site: _Site) -> None:
        """Checks the parameters, captures and globals of one compiled def or lambda."""
        name = fn.name if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) else "<lambda>"
        if self._suppressed(fn, site):
            return
        params = _all_params(fn)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and self._is_method(fn):
            params = params[1:]
        guarded = _guarded_params(fn) if not isinstance(fn, ast.Lambda) else set()
        names = {p.arg.arg for p in params}
        usage = _Usage(_scope_body(fn), names, self)
        for param in params:
            pname = param.arg.arg
            if pname in site.skip_params or pname in guarded:
                continue
            why = self._float_reason(param, usage)
            if why:
                self.flagged_params.add((fn, pname))
                self._add(
                    param.arg.lineno, name, pname, f"{why}; compiled via {site.via}", "parameter"
                )
        self._check_free_names(fn, name, site)

    def _check_free_names(self, fn: _FunctionNode | ast.Lambda, name: str, site: _Site) -> None:
        """Reports closure captures and reads of reassigned module-level floats."""
        # Names bound anywhere inside ``fn`` (nested scopes included) are not captures.
        local = set(_bound_names(fn))
        for node in ast.walk(ast.Module(body=_scope_body(fn), type_ignores=[])):
            if isinstance(node, ast.arg):
                local.add(node.arg)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                local.add(node.id)
        scopes = [s for s in self._scopes(fn) if not isinstance(s, ast.ClassDef)]
        loads = [n for n in _name_loads(fn) if n.id not in local]
        free = {n.id for n in loads}
        usage = _Usage(_scope_body(fn), free, self)
        callees = {
            node.func.id
            for node in ast.walk(ast.Module(body=_scope_body(fn), type_ignores=[]))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        }
        reported: set[str] = set()
        for load in loads:
            var = load.id
            if var in reported:
                continue
            owner = next((s for s in scopes if var in self._bound(s)), None)
            if owner is None:
                continue
            how = self._bound(owner)[var]
            if isinstance(owner, ast.Module):
                if var in self.mutable_floats:
                    reported.add(var)
                    why = f"reassigned at line {self.mutable_floats[var]}; compiled via {site.via}"
                    self._add(load.lineno, name, var, why, "global")
                continue
            if how in ("def", "import") or var in usage.tensor_like:
                continue
            if var in callees and var not in usage.scalar:
                continue
            if how == "param":
                param = next(p for p in _all_params(owner) if p.arg.arg == var)
                ann = param.arg.annotation
                if ann is not None and _is_tensor_type(ann):
                    continue
            reported.add(var)
            why = (
                f"bound in '{getattr(owner, 'name', '<lambda>')}'; a closure value is baked "
                f"into the compiled code; compiled via {site.via}"
            )
            self._add(load.lineno, name, var, why, "closure")

    def check_partial(self, call: ast.Call, site: _Site) -> None:
        """Checks ``torch.compile(functools.partial(fn, ...))``."""
        if self._suppressed(None, site):
            return
        defs = self._resolve_def(call.args[0], call) if call.args else []
        fn = defs[0] if defs else None
        fname = fn.name if fn else (ast.unparse(call.args[0]) if call.args else "<partial>")
        positional = []
        if fn is not None:
            positional = [*fn.args.posonlyargs, *fn.args.args][1 if self._is_method(fn) else 0 :]
        bound: list[tuple[str, ast.expr]] = []
        for index, value in enumerate(call.args[1:]):
            if isinstance(value, ast.Starred):
                break
            pname = positional[index].arg if index < len(positional) else f"<positional {index}>"
            bound.append((pname, value))
        bound += [(kw.arg, kw.value) for kw in call.keywords if kw.arg]
        for pname, value in bound:
            constant = _int_literal(value) or (
                isinstance(value, ast.Constant)
                and (value.value is None or isinstance(value.value, str | bytes | bool))
            )
            if constant or (fn is not None and self._suppressed(fn, site)):
                continue
            why = f"bound to {ast.unparse(value)}; compiled via {site.via}"
            self._add(value.lineno, fname, pname, why, "partial")
        for fn in defs:
            self.targets.add(fn)
            skip = frozenset(p for p, _ in bound)
            self.check_function(fn, _Site(site.via, site.pragma_lines, skip))

    def _check_target(self, target: ast.expr, site: _Site, call: ast.Call) -> None:
        if isinstance(target, ast.Lambda):
            self.targets.add(target)
            self.check_function(target, site)
        elif isinstance(target, ast.Call) and self.dotted(target.func) == "functools.partial":
            self.targets.add(target)
            self.check_partial(target, site)
        else:
            for fn in self._resolve_def(target, call):
                self.targets.add(fn)
                self.check_function(fn, site)
                if isinstance(self.parents.get(call), ast.Assign):
                    for out in self.parents[call].targets:
                        if isinstance(out, ast.Name):
                            self.callable_names[out.id] = (fn, site)

    def check_call_sites(self) -> None:
        """Reports float literals passed to compiled functions called by name in this module."""
        for call in ast.walk(self.tree):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                continue
            if call.func.id not in self.callable_names:
                continue
            fn, site = self.callable_names[call.func.id]
            if self._is_method(fn) or self._suppressed(fn, site, call.lineno):
                continue
            positional = [*fn.args.posonlyargs, *fn.args.args]
            passed: list[tuple[str, ast.expr]] = []
            for index, value in enumerate(call.args):
                if isinstance(value, ast.Starred):
                    break
                if index < len(positional):
                    passed.append((positional[index].arg, value))
            passed += [(kw.arg, kw.value) for kw in call.keywords if kw.arg]
            guarded = _guarded_params(fn)
            for pname, value in passed:
                is_float = _float_literal(value) or (
                    isinstance(value, ast.Call) and self.dotted(value.func) == "float"
                )
                if not is_float or pname in guarded or (fn, pname) in self.flagged_params:
                    continue
                why = f"{ast.unparse(value)} passed to '{fn.name}'; compiled via {site.via}"
                self._add(value.lineno, fn.name, pname, why, "call")

    def run(self) -> None:
        """Finds every compiled function in the module and checks it."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for decorator in node.decorator_list:
                    label = self.compiler_label(decorator)
                    if label:
                        site = _Site(f"@{label}")
                        self.targets.add(node)
                        self.check_function(node, site)
                        self.callable_names.setdefault(node.name, (node, site))
                        break
            elif isinstance(node, ast.Call):
                self._check_compiling_call(node)
        self.check_call_sites()
        self._check_pragmas()

    def _check_compiling_call(self, call: ast.Call) -> None:
        if isinstance(call.func, ast.Call):
            label = self.compiler_label(call.func)  # torch.compile(mode=...)(fn)
        elif isinstance(call.func, ast.Name | ast.Attribute):
            label = self.compiler_label(call.func)
        else:
            label = None
        target = call.args[0] if call.args else None
        if target is None:
            target = next((kw.value for kw in call.keywords if kw.arg in ("model", "fn")), None)
        if not label or target is None:
            return
        lines = frozenset(range(call.lineno, (call.end_lineno or call.lineno) + 1))
        self._check_target(target, _Site(f"{label} call at line {call.lineno}", lines), call)

    def _check_pragmas(self) -> None:
        functions = [
            n for n in ast.walk(self.tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]
        for line, text in sorted(self.bad_pragmas.items()):
            owner = "<module>"
            for fn in functions:
                if line in self._def_pragma_lines(fn):
                    owner = fn.name
            why = f"{text!r}: expected {_PRAGMA_FORM} with a non-empty reason"
            self._add(line, owner, None, why, "pragma")


# ---------------------------------------------------------------------------------------------
# Public API


def _check(source: str, path: str) -> tuple[list[Finding], int]:
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        raise CheckError(
            f"{path}:{err.lineno or 0}:{err.offset or 0}: cannot parse: {err.msg}"
        ) from None
    except ValueError as err:  # e.g. null bytes
        raise CheckError(f"{path}: cannot parse: {err}") from None
    checker = _ModuleChecker(tree, source, path)
    checker.run()
    unique = {(f.line, f.function, f.parameter, f.kind): f for f in reversed(checker.findings)}
    return sorted(unique.values()), len(checker.targets)


def check_source(source: str, filename: str = "<string>") -> list[Finding]:
    """Checks the Python source of one module.

    Args:
        source: Module source text.
        filename: Name used in findings and errors.

    Returns:
        The findings, sorted by line.

    Raises:
        CheckError: If ``source`` is not valid Python.
    """
    return _check(source, filename)[0]


def _iter_files(paths: Iterable[str | os.PathLike[str]]) -> Iterator[tuple[Path, str]]:
    """Python files under ``paths``, shown as given; a missing path raises CheckError."""
    for raw in paths:
        root = Path(raw)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(
                p
                for p in root.rglob("*.py")
                if not any(
                    part.startswith(".") or part == "__pycache__"
                    for part in p.relative_to(root).parts
                )
            )
        else:
            raise CheckError(f"{raw}: no such file or directory")
        for file in files:
            yield file, str(file)


def _scan(paths: Iterable[str | os.PathLike[str]]) -> _Report:
    report = _Report()
    try:
        files = list(_iter_files(paths))
    except CheckError as err:
        report.errors.append(str(err))
        return report
    for file, shown in files:
        report.files += 1
        try:
            with tokenize.open(file) as handle:
                source = handle.read()
        except (OSError, SyntaxError, UnicodeDecodeError) as err:
            report.errors.append(f"{shown}: cannot read: {err}")
            continue
        try:
            findings, compiled = _check(source, shown)
        except CheckError as err:
            report.errors.append(str(err))
            continue
        report.findings += findings
        report.compiled += compiled
    return report


def check_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Finding]:
    """Checks every ``.py`` file in ``paths`` (files or directories, searched recursively).

    Hidden directories and ``__pycache__`` are skipped.

    Args:
        paths: Files and directories to check.

    Returns:
        All findings, sorted by path and line.

    Raises:
        CheckError: If a path does not exist or a file cannot be read or parsed; every other file
            is still checked first, and the message lists all such files.
    """
    report = _scan(paths)
    if report.errors:
        raise CheckError("\n".join(report.errors))
    return sorted(report.findings)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        0 when clean, 1 when there are findings, 2 when a path could not be checked.
    """
    parser = argparse.ArgumentParser(
        description="Report compiled functions that can receive an unguarded Python float."
    )
    parser.add_argument(
        "paths",
        nargs="*",
        help="files or directories to check (default: mcore_activations/ and megatron/)",
    )
    parser.add_argument("--quiet", action="store_true", help="print findings only, no summary")
    args = parser.parse_args(argv)
    paths = args.paths or [_shown(path) for path in DEFAULT_PATHS]
    report = _scan(paths)
    for finding in sorted(report.findings):
        print(finding)
    for error in report.errors:
        print(f"error: {error}", file=sys.stderr)
    if not args.quiet:
        print(
            f"check_compiled_scalars: {report.compiled} compiled function(s) in {report.files} "
            f"file(s) checked, {len(report.findings)} finding(s), {len(report.errors)} error(s)"
        )
    if report.errors:
        return 2
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
