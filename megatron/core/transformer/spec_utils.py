"""Module specs: which class builds each part of a layer, decided outside the layer.

A layer receives a ``ModuleSpec`` (or a dataclass of submodule specs) instead of hard-coding
``ColumnParallelLinear`` or ``TELinear``; ``build_module`` turns the spec into an object. Swapping
a backend is then a change of spec, not of the layer's code.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass
class ModuleSpec:
    """What to build for one part of a model.

    Attributes:
        module: The class or function to build, or an import path to it: a ``(module_path,
            name)`` tuple or a dotted string such as ``"torch.nn.Linear"``.
        params: Keyword arguments the spec always passes to ``module``.
        submodules: Specs of the module's own parts, passed on as ``submodules=``; usually a
            dataclass such as ``MLPSubmodules``.
        metainfo: Free-form information about the spec for tools; never passed to ``module``.
    """

    module: Union[tuple[str, str], str, type, Callable]
    params: dict = field(default_factory=dict)
    submodules: Any = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``build_module(self, *args, **kwargs)``: a spec builds what it describes."""
        return build_module(self, *args, **kwargs)


def import_module(module_path: Union[tuple[str, str], str]) -> Any:
    """Imports the object a spec names by path.

    Args:
        module_path: ``(module_path, name)``, e.g. ``("torch.nn", "Linear")``, or the dotted
            string ``"torch.nn.Linear"``.

    Returns:
        The named class, function or other attribute.
    """
    if isinstance(module_path, str):
        base_path, _, name = module_path.rpartition(".")
    else:
        base_path, name = module_path
    if not base_path or not name:
        raise ValueError(
            f"module path {module_path!r} must name a module and an attribute, "
            "e.g. ('torch.nn', 'Linear') or 'torch.nn.Linear'."
        )
    # ImportError in both failure cases, with upstream's phrases, which callers match on.
    try:
        module = importlib.import_module(base_path)
    except ImportError as error:
        raise ImportError(
            f"Could not import module '{base_path}' for spec '{name}': {error}"
        ) from error
    try:
        return getattr(module, name)
    except AttributeError as error:
        raise ImportError(f"Could not find spec '{name}' in module '{base_path}'") from error


def get_module(spec_or_module: Union[ModuleSpec, type, Callable], **additional_kwargs) -> Any:
    """Returns the class or function a spec names, importing it when named by path.

    Args:
        spec_or_module: A ``ModuleSpec``, or a class or function (returned as it is).
        **additional_kwargs: Accepted for upstream's signature; unused.

    Raises:
        ImportError: The spec names a module or attribute that does not exist.
    """
    del additional_kwargs
    if isinstance(spec_or_module, type | types.FunctionType):
        return spec_or_module
    module = spec_or_module.module
    if isinstance(module, type | types.FunctionType):
        return module
    return import_module(module)


class MissingSubmodulesKeywordError(KeyError, ValueError):
    """A ``functools.partial`` spec binds no ``submodules``: a ``KeyError`` (upstream's type for
    this case) and a ``ValueError`` (the type for any other spec without submodules)."""

    def __str__(self) -> str:
        # KeyError's str() would show the message quoted; show it as written.
        return str(self.args[0]) if self.args else ""


def get_submodules(spec: Any) -> Any:
    """Returns the ``submodules`` a spec carries.

    Args:
        spec: A ``ModuleSpec`` or any object with a ``submodules`` attribute, or a
            ``functools.partial`` that binds ``submodules=``.

    Raises:
        ValueError: ``spec`` carries no submodules (e.g. a bare class).
        MissingSubmodulesKeywordError: ``spec`` is a partial without ``submodules=`` (both a
            ``KeyError``, as upstream, and a ``ValueError``).
    """
    if isinstance(spec, functools.partial):
        if "submodules" in spec.keywords:
            return spec.keywords["submodules"]
        # Upstream looks the keyword up and so raises KeyError here; the error is also a
        # ValueError, the type raised for every other spec without submodules.
        raise MissingSubmodulesKeywordError(
            f"{spec!r} binds no 'submodules' keyword (a partial passes them as submodules=...)."
        )
    if hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"{spec!r} carries no submodules (not a ModuleSpec or partial with them).")


def _resolve(target: Any) -> Any:
    if isinstance(target, tuple | str):
        return import_module(target)
    return target


def build_module(spec_or_module: Union[ModuleSpec, type, Callable], *args, **kwargs) -> Any:
    """Builds what a spec describes.

    - A function (given directly, or as a spec's ``module``) is returned as is, not called:
      specs use functions for factories the layer calls itself later (e.g. bias-dropout-add).
    - A class is called with ``*args``, ``submodules=spec.submodules`` when the spec has
      submodules, the spec's ``params`` and ``**kwargs``.

    Args:
        spec_or_module: A ``ModuleSpec``, a class, a function or an import path.
        *args: Positional arguments for the class.
        **kwargs: Keyword arguments for the class. A key that is also in ``spec.params`` is an
            error: the spec and the caller must not both decide one argument.

    Returns:
        The built object, or the function itself.

    Raises:
        TypeError: When ``kwargs`` repeats a key of ``spec.params`` or ``submodules``.
    """
    spec = spec_or_module if isinstance(spec_or_module, ModuleSpec) else None
    module = _resolve(spec.module if spec is not None else spec_or_module)

    if isinstance(module, types.FunctionType | types.BuiltinFunctionType | types.MethodType):
        return module

    spec_kwargs = dict(spec.params) if spec is not None else {}
    if spec is not None and spec.submodules is not None:
        spec_kwargs["submodules"] = spec.submodules
    duplicates = sorted(spec_kwargs.keys() & kwargs.keys())
    if duplicates:
        raise TypeError(
            f"build_module({getattr(module, '__name__', module)}): argument(s) {duplicates} are "
            "set both by the ModuleSpec (params / submodules) and by the caller; set each in "
            "one place."
        )

    try:
        return module(*args, **spec_kwargs, **kwargs)
    except Exception as error:
        # The traceback of a failed build points into the module; a note names the spec's target
        # (in newer upstream's wording), so a failure deep inside a model build can be traced
        # back through every level of specs. The exception itself, its type, attributes and
        # cause, is re-raised unchanged. (Exception notes arrived in Python 3.11.)
        if hasattr(error, "add_note"):
            error.add_note(f"when instantiating {getattr(module, '__name__', module)}")
        raise
