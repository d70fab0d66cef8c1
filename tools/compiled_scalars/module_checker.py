"""The per-module part of the compiled-scalar checker: finds a module's compiled functions (by
decorator, compiling call or compiling factory) and checks each (docs/compiled-scalar-checker.md).
"""

from __future__ import annotations

import ast

from tools.compiled_scalars.syntax import (
    _PRAGMA_FORM,
    Finding,
    _all_params,
    _bound_names,
    _float_literal,
    _FunctionNode,
    _guarded_params,
    _int_literal,
    _is_float_type,
    _is_tensor_type,
    _name_loads,
    _Param,
    _pragmas,
    _scope_body,
    _ScopeNode,
    _Site,
    _Usage,
    _walk_scope,
)


class _ModuleChecker:
    """Finds compiled functions in one parsed module and checks them."""

    def __init__(
        self,
        tree: ast.Module,
        source: str,
        path: str,
        external_factories: dict[str, int] | None = None,
    ):
        self.tree = tree
        self.path = path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.aliases: dict[str, str] = {}
        self.compiler_aliases: dict[str, str] = {}
        # Functions that compile one of their parameters: name (dotted, for other modules'
        # factories) -> that parameter's position.
        self.factories: dict[str, int] = {}
        self.external_factories = dict(external_factories or {})
        self._collect_aliases()
        self.factories = self.find_factories()
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

    def factory_position(self, node: ast.AST) -> int | None:
        """The compiled parameter's position when ``node`` names a compiling factory."""
        if isinstance(node, ast.Name) and node.id in self.factories:
            return self.factories[node.id]
        dotted = self.dotted(node)
        if not dotted or "." not in dotted:
            return None
        # Another module's factory, by its dotted name (or the tail of it the import names).
        for name, position in self.external_factories.items():
            if name == dotted or name.endswith(f".{dotted.lstrip('.')}"):
                return position
        return None

    def find_factories(self) -> dict[str, int]:
        """Module-level functions that compile a parameter, directly or through another factory.

        ``def compile_rows(fn): return torch.compile(fn)`` makes ``compile_rows(kernel)`` a
        compiling call of ``kernel``; found to a fixed point, so factories of factories count.
        """
        defs = [node for node in self.tree.body if isinstance(node, _FunctionNode)]
        changed = True
        while changed:
            changed = False
            for fn in defs:
                if fn.name in self.factories:
                    continue
                params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
                for call in ast.walk(ast.Module(body=fn.body, type_ignores=[])):
                    target = self._compiled_argument(call) if isinstance(call, ast.Call) else None
                    if isinstance(target, ast.Name) and target.id in params:
                        self.factories[fn.name] = params.index(target.id)
                        changed = True
                        break
        return self.factories

    def _compiled_argument(self, call: ast.Call) -> ast.expr | None:
        """The function a compiling call compiles, or None when ``call`` compiles nothing."""
        position = self.factory_position(call.func)
        if position is None:
            position = 0
            if isinstance(call.func, ast.Call | ast.Name | ast.Attribute):
                if not self.compiler_label(call.func):
                    return None
            else:
                return None
        if position < len(call.args):
            return call.args[position]
        if position == 0:
            return next((kw.value for kw in call.keywords if kw.arg in ("model", "fn")), None)
        return None

    def compiler_label(self, node: ast.AST) -> str | None:
        """How ``node`` compiles a function, if it is a compiler (decorator or wrapping callee)."""
        if self.factory_position(node) is not None:
            return f"factory {ast.unparse(node)}()"
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

    def _structural(self, annotation: ast.expr) -> bool:
        """Whether a value of this annotation is structure, not a number that may change.

        True for ``int`` / ``str`` / ``bool`` / ``bytes``, and for a class of this module whose
        annotated fields are all structural (e.g. a NamedTuple of flags). Dynamo guards on such a
        captured value and compiles once per value, which is the intent for structure.
        """
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return False
        if _is_float_type(annotation):
            return False
        if isinstance(annotation, ast.Name) and annotation.id in ("int", "str", "bool", "bytes"):
            return True
        if isinstance(annotation, ast.Subscript):  # Optional[int], tuple[str, ...]
            parts = [n for n in ast.walk(annotation.slice) if isinstance(n, ast.Name)]
            return bool(parts) and all(
                n.id in ("int", "str", "bool", "bytes", "None") for n in parts
            )
        if isinstance(annotation, ast.Name):
            classes = [
                node
                for node in self.tree.body
                if isinstance(node, ast.ClassDef) and node.name == annotation.id
            ]
            if len(classes) == 1:
                fields = [n for n in classes[0].body if isinstance(n, ast.AnnAssign)]
                return bool(fields) and all(self._structural(f.annotation) for f in fields)
        return False

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
                if ann is not None and (_is_tensor_type(ann) or self._structural(ann)):
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
        elif isinstance(target, ast.Call):
            # A wrapper around a def (``torch.compile(rename(kernel, tag))``): the defs it is
            # given are what gets compiled.
            for arg in target.args:
                if self._resolve_def(arg, call):
                    self._check_target(arg, site, call)
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
        target = self._compiled_argument(call)
        if target is None:
            return
        label = self.compiler_label(call.func)
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
