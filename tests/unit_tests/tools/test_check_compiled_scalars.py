"""Tests for tools/check_compiled_scalars.py, the CI gate against stale floats in compiled code.

Each bad case is a small module written to a temporary file; a test asserts the checker reports
the right function, parameter and line, and that the fixed form of the same code is clean.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.check_compiled_scalars import CheckError, Finding, check_paths, check_source

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "tools" / "check_compiled_scalars.py"

HEADER = """\
import functools
import math
import numbers
import typing
from functools import partial
from typing import Optional, SupportsFloat, Union

import torch
from torch import Tensor

from megatron.core.jit import jit_fuser
"""
HEADER_LINES = HEADER.count("\n")

# The pragma text is assembled so that this test file carries no pragma comment of its own.
PRAGMA = "# compiled-scalar" + ": ok"


def _module(body: str) -> str:
    return HEADER + textwrap.dedent(body)


def _line(source: str, marker: str) -> int:
    """1-based line of the only line of ``source`` containing ``marker``."""
    lines = [i for i, text in enumerate(source.splitlines(), start=1) if marker in text]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def _check_file(tmp_path: Path, body: str) -> tuple[str, list[Finding]]:
    source = _module(body)
    path = tmp_path / "planted.py"
    path.write_text(source)
    return source, check_paths([path])


def _one(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, "\n".join(map(str, findings))
    return findings[0]


def _run_cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


# ---------------------------------------------------------------------------------------------
# Bad forms are caught, on the right line


@pytest.mark.parametrize(
    "annotation",
    [
        "float",
        "Optional[float]",
        "typing.Optional[float]",
        "float | None",
        "Union[int, float]",
        "SupportsFloat",
        "numbers.Real",
        "'Optional[float]'",
        "tuple[float, float]",
    ],
)
def test_float_annotation_is_caught(tmp_path, annotation):
    source, findings = _check_file(
        tmp_path,
        f"""
        @torch.compile
        def clamp_it(x: torch.Tensor, c: {annotation}) -> torch.Tensor:  # the def
            return x.clamp(-c, c)
        """,
    )
    finding = _one(findings)
    assert (finding.function, finding.parameter) == ("clamp_it", "c")
    assert finding.line == _line(source, "# the def")
    assert finding.path.endswith("planted.py")
    assert "annotated" in finding.reason and "@torch.compile" in finding.reason


@pytest.mark.parametrize("default", ["0.0", "-1.5", "+2.0"])
def test_float_default_is_caught_even_with_tensor_annotation(default):
    for annotation in ("", ": torch.Tensor"):
        source = _module(
            f"""
            @jit_fuser
            def gelu_offset(y, linear_offset{annotation} = {default}):
                return y + linear_offset
            """
        )
        finding = _one(check_source(source, "m.py"))
        assert (finding.parameter, finding.line) == ("linear_offset", _line(source, "def "))
        assert "float default" in finding.reason


def test_int_default_is_caught_only_when_unannotated():
    source = _module(
        """
        @jit_fuser
        def f(y, offset=0, dim: int = -1, flag=True, name="x", other=None):
            return y.sum(dim) + offset
        """
    )
    finding = _one(check_source(source))
    assert finding.parameter == "offset" and "numeric default 0" in finding.reason


@pytest.mark.parametrize(
    "expression, evidence",
    [
        ("x.clamp(min=-c, max=c)", "passed as min="),
        ("torch.clamp(x, -c, c)", "passed to clamp()"),
        ("x.clamp(-c, c)", "passed to clamp()"),
        ("torch.clamp_max(x, c)", "passed to clamp_max()"),
        ("torch.nn.functional.hardtanh(x, -c, c)", "passed to hardtanh()"),
        ("x * (c > 0)", "compared with 0"),
        ("x * (c * 0.5)", "arithmetic with 0.5"),
        ("x * (1.0 - c)", "arithmetic with 1.0"),
        ("x * float(c)", "passed to float()"),
        ("x * math.sqrt(c)", "passed to math.sqrt()"),
    ],
)
def test_unannotated_scalar_use_is_caught(tmp_path, expression, evidence):
    source, findings = _check_file(
        tmp_path,
        f"""
        @torch.compile
        def clamped(x, c):  # the def
            return {expression}
        """,
    )
    finding = _one(findings)
    assert (finding.parameter, finding.line) == ("c", _line(source, "# the def"))
    assert evidence in finding.reason, finding.reason
    assert f"at line {_line(source, 'return')}" in finding.reason


@pytest.mark.parametrize(
    "decorator",
    [
        "@jit_fuser",
        "@torch.compile",
        "@torch.compile()",
        "@torch.compile(dynamic=True, mode='max-autotune')",
        "@torch.jit.script",
        "@tc",
        "@tc(fullgraph=True)",
        "@fuse",
        "@jit.jit_fuser",
        "@functools.partial(torch.compile, mode='reduce-overhead')",
        "@torch._dynamo.optimize('inductor')",
    ],
)
def test_every_compiling_decorator_is_recognized(decorator):
    source = _module(
        f"""
        from torch import compile as tc
        from megatron.core import jit

        fuse = torch.compile


        {decorator}
        def scaled(x, scale: float):
            return x * scale
        """
    )
    finding = _one(check_source(source))
    assert (finding.function, finding.line) == ("scaled", _line(source, "def scaled"))


def test_uncompiled_function_is_not_checked():
    source = _module(
        """
        @torch.compiler.disable
        def eager(x, c: float = 0.5):
            return x.clamp(-c, c)
        """
    )
    assert check_source(source) == []


@pytest.mark.parametrize(
    "wrap",
    [
        "fused = torch.compile(clamped)",
        "fused = torch.compile(clamped, mode='max-autotune', dynamic=True)",
        "fused = jit_fuser(clamped)",
        "fused = torch.compile(mode='max-autotune')(clamped)",
        "fused = torch.jit.script(clamped)",
        "fused = torch.compile(model=clamped)",
    ],
)
def test_call_form_is_caught_at_the_parameter(tmp_path, wrap):
    source, findings = _check_file(
        tmp_path,
        f"""
        def clamped(x, c):  # the def
            return x.clamp(min=-c, max=c)


        {wrap}
        """,
    )
    finding = _one(findings)
    assert (finding.function, finding.parameter) == ("clamped", "c")
    assert finding.line == _line(source, "# the def")
    assert f"call at line {_line(source, 'fused =')}" in finding.reason


def test_call_form_resolves_nested_defs_and_methods():
    source = _module(
        """
        class Block:
            def build(self):
                def inner(x, c: float):  # inner def
                    return x * c

                self.a = torch.compile(inner)
                self.b = torch.compile(self._impl)

            def _impl(self, x, beta=1.0):  # method def
                return x * beta
        """
    )
    findings = check_source(source)
    assert [(f.function, f.parameter, f.line) for f in findings] == [
        ("inner", "c", _line(source, "# inner def")),
        ("_impl", "beta", _line(source, "# method def")),
    ]


def test_compiled_method_skips_self():
    source = _module(
        """
        class M(torch.nn.Module):
            @torch.compile
            def forward(self, x, scale: torch.Tensor):
                return x * scale
        """
    )
    assert check_source(source) == []


def test_partial_is_caught_at_the_compile_call(tmp_path):
    source, findings = _check_file(
        tmp_path,
        """
        def clamped(x, c, alpha, dim: int = -1):
            return x.clamp(-c, c).softmax(dim) * alpha


        def build(clamp_value):
            a = torch.compile(functools.partial(clamped, c=clamp_value, dim=-1))  # first
            b = jit_fuser(partial(clamped, alpha=1.702))  # second
            return a, b
        """,
    )
    partials = [f for f in findings if f.kind == "partial"]
    assert [(f.function, f.parameter, f.line) for f in partials] == [
        ("clamped", "c", _line(source, "# first")),
        ("clamped", "alpha", _line(source, "# second")),
    ]
    assert "bound to clamp_value" in partials[0].reason
    assert "baked in by functools.partial" in str(partials[0])
    # The parameter left free by the second partial is still checked as a compiled parameter.
    rest = [f for f in findings if f.kind != "partial"]
    assert [(f.parameter, f.kind) for f in rest] == [("c", "parameter")]


def test_lambda_and_closure_captures_are_caught():
    source = _module(
        """
        def make(clamp_value, weight: torch.Tensor):
            return torch.compile(lambda x: x.clamp(-clamp_value, clamp_value) * weight)


        def make_nested(scale):
            @jit_fuser
            def inner(x):
                return x * scale  # capture

            return inner


        def make_lambda_default():
            return torch.compile(lambda x, c=0.5: x * c)  # lambda default
        """
    )
    findings = check_source(source)
    assert [(f.function, f.parameter, f.kind, f.line) for f in findings] == [
        ("<lambda>", "clamp_value", "closure", _line(source, "lambda x: x.clamp")),
        ("inner", "scale", "closure", _line(source, "# capture")),
        ("<lambda>", "c", "parameter", _line(source, "# lambda default")),
    ]


def test_reassigned_module_float_is_caught():
    source = _module(
        """
        CLAMP = 7.0
        FIXED = 1.702


        def set_clamp(value):
            global CLAMP
            CLAMP = value  # reassignment


        @torch.compile
        def clamped(x: torch.Tensor) -> torch.Tensor:
            return x.clamp(-CLAMP, CLAMP) * FIXED  # the read
        """
    )
    finding = _one(check_source(source))
    assert (finding.parameter, finding.kind, finding.line) == (
        "CLAMP",
        "global",
        _line(source, "# the read"),
    )
    assert f"reassigned at line {_line(source, '# reassignment')}" in finding.reason


def test_float_literal_at_call_site_is_caught():
    source = _module(
        """
        @jit_fuser
        def scaled(x, s):
            return x * s


        def eager(x, s):
            return x * s


        fused = torch.compile(eager)
        a = scaled(torch.ones(2), 0.5)  # first call
        b = fused(torch.ones(2), s=float("2"))  # second call
        c = eager(torch.ones(2), 0.5)
        """
    )
    findings = check_source(source)
    assert [(f.function, f.parameter, f.kind, f.line) for f in findings] == [
        ("scaled", "s", "call", _line(source, "# first call")),
        ("eager", "s", "call", _line(source, "# second call")),
    ]


def test_factory_compiling_its_parameter_is_seen():
    # The project's kernels are made this way: a factory calls torch.compile on a parameter, and
    # callers hand it a def (through a wrapper that renames it). Factories of factories count.
    source = _module(
        """
        def compile_rows(fn):
            compiled = torch.compile(fn)

            def run(*args):
                return compiled(*args)

            return run


        def compile_again(tag, fn):
            return compile_rows(fn)


        def rename(fn, name):
            return fn


        class Flags(typing.NamedTuple):
            gated: bool
            block: Optional[int]


        def make(flags: Flags, clamp):
            def kernel(x, c: float):  # factory kernel
                return x.clamp(max=c) if flags.gated else x

            def other(x, params):
                return x * clamp  # captured number

            return compile_rows(rename(kernel, "k")), compile_again("t", other)
        """
    )
    findings = check_source(source)
    assert [(f.function, f.parameter, f.kind, f.line) for f in findings] == [
        ("kernel", "c", "parameter", _line(source, "# factory kernel")),
        ("other", "clamp", "closure", _line(source, "# captured number")),
    ]
    assert "compiled via factory compile_rows() call at line" in str(findings[0])
    assert "compiled via factory compile_again() call at line" in str(findings[1])


def test_factory_imported_from_another_module_is_seen(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "factories.py").write_text(
        _module("def compile_rows(fn):\n    return torch.compile(fn)\n")
    )
    user = _module(
        """
        from pkg.factories import compile_rows
        from pkg import factories


        def kernel(x, c: float):  # first
            return x * c


        def other(x, c: float):  # second
            return x * c


        KERNELS = compile_rows(kernel), factories.compile_rows(other)
        """
    )
    (package / "user.py").write_text(user)
    findings = check_paths([package])
    assert [(Path(f.path).name, f.function, f.line) for f in findings] == [
        ("user.py", "kernel", _line(user, "# first")),
        ("user.py", "other", _line(user, "# second")),
    ]


def test_captured_structure_passes_and_captured_numbers_do_not():
    source = _module(
        """
        class Flags(typing.NamedTuple):
            gated: bool
            block: Optional[int]


        class Scales(typing.NamedTuple):
            clamp: float


        def helper(what, x):
            return x


        def make(flags: Flags, scales: Scales, width: int):
            def kernel(x):
                return helper(flags, x) + helper(width, x)

            def stale(x):
                return helper(scales, x)  # float field

            return torch.compile(kernel), torch.compile(stale)
        """
    )
    findings = check_source(source)
    assert [(f.function, f.parameter, f.kind, f.line) for f in findings] == [
        ("stale", "scales", "closure", _line(source, "# float field")),
    ]


def test_repo_kernels_made_by_a_factory_are_checked():
    # The compiled kernels of activation_kernels come from compile_with_dynamic_rows(fn): the
    # checker must count them (it once saw only the @jit_fuser helpers).
    result = _run_cli("mcore_activations/fusions/activation_kernels.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("check_compiled_scalars: 2 compiled function(s) in 1 file(s)")


# ---------------------------------------------------------------------------------------------
# Fixed forms pass


def test_tensor_annotated_clamp_passes(tmp_path):
    _, findings = _check_file(
        tmp_path,
        """
        @jit_fuser
        def clamped(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return x.clamp(min=-c, max=c)


        @torch.compile
        def clamped_opt(x: Tensor, c: Optional[Tensor] = None) -> Tensor:
            return x if c is None else torch.clamp(x, -c, c)


        def wrapped(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
            return x.clamp(max=params[0])


        fused = torch.compile(wrapped)
        """,
    )
    assert findings == []


def test_tensor_like_usage_is_not_flagged():
    source = _module(
        """
        @torch.compile
        def clamped(x, c):
            c = c.to(x.dtype)
            return x.clamp(-c, c)


        @torch.compile
        def by_shape(x, w):
            return x.clamp(min=-w, max=w) if w.size(0) > 1 else x
        """
    )
    assert check_source(source) == []


@pytest.mark.parametrize(
    "placement", ["def", "decorator", "signature", "call", "partial call", "lambda call"]
)
def test_pragma_with_reason_suppresses(placement):
    pragma = f"{PRAGMA} (value fixed for the process lifetime)"
    def_line = f"  {pragma}" if placement == "def" else ""
    dec_line = f"  {pragma}" if placement == "decorator" else ""
    sig_line = f"  {pragma}" if placement == "signature" else ""
    call_line = f"  {pragma}" if placement.endswith("call") else ""
    if placement == "call":
        compiled = f"fused = torch.compile(scaled){call_line}"
        decorator = ""
    elif placement == "partial call":
        compiled = f"fused = torch.compile(partial(scaled, s=SCALE)){call_line}"
        decorator = ""
    elif placement == "lambda call":
        compiled = f"fused = torch.compile(lambda x, s=0.5: scaled(x, s)){call_line}"
        decorator = ""
    else:
        compiled = ""
        decorator = f"@torch.compile{dec_line}"
    source = _module(
        f"""
        SCALE = 0.5


        {decorator}
        def scaled({def_line}
            x,
            s: float,
        ):{sig_line}
            return x * s


        {compiled}
        """
    )
    assert check_source(source) == []


@pytest.mark.parametrize(
    "guard",
    [
        "assert isinstance(c, torch.Tensor)",
        "assert isinstance(c, Tensor), 'c must be a tensor'",
        "assert isinstance(c, (torch.Tensor, torch.nn.Parameter))",
        "assert x.dim() > 0 and isinstance(c, torch.Tensor)",
        "assert not isinstance(c, float)",
        "assert not isinstance(c, (int, float))",
        "if isinstance(c, float):\n    raise TypeError('c must be a tensor')",
        "if isinstance(c, (int, float)) or x is None:\n    raise TypeError('c must be a tensor')",
        "if not isinstance(c, torch.Tensor):\n    msg = 'need a tensor'\n    raise TypeError(msg)",
    ],
)
def test_isinstance_guard_suppresses(guard):
    body = textwrap.indent(guard, " " * 4)
    source = HEADER + (
        "\n\n@torch.compile\n"
        "def clamped(x, c: Optional[float] = None, d=0.5):\n"
        '    """Docstring first is fine."""\n'
        "    assert isinstance(d, torch.Tensor)\n"
        f"{body}\n"
        "    return x.clamp(min=-c, max=c) * d\n"
        "\n\nout = clamped(torch.ones(2), 0.5, d=1.5)\n"
    )
    assert check_source(source) == []


@pytest.mark.parametrize(
    "guard",
    [
        "assert isinstance(c, (torch.Tensor, float))",  # admits floats
        "assert isinstance(c, torch.Tensor) or x is None",  # may not hold for c
        "if isinstance(c, float):\n    c = torch.tensor(c)",  # converts inside compiled code
        "y = x\nassert isinstance(c, torch.Tensor)",  # not a leading statement
    ],
)
def test_unrecognized_guards_do_not_suppress(guard):
    body = textwrap.indent(guard, " " * 4)
    source = HEADER + (
        f"\n\n@torch.compile\ndef clamped(x, c: float):\n{body}\n    return x.clamp(-c, c)\n"
    )
    assert _one(check_source(source)).parameter == "c"


@pytest.mark.parametrize(
    "pragma", [PRAGMA, f"{PRAGMA} ()", f"{PRAGMA} (   )", "# compiled-scalar: fine"]
)
def test_pragma_without_reason_is_a_finding_and_suppresses_nothing(pragma):
    source = _module(
        f"""
        @torch.compile  {pragma}
        def scaled(x, s: float):
            return x * s
        """
    )
    findings = check_source(source)
    assert [(f.kind, f.function, f.line) for f in findings] == [
        ("pragma", "scaled", _line(source, "@torch.compile")),
        ("parameter", "scaled", _line(source, "def scaled")),
    ]
    assert findings[0].parameter is None
    assert "invalid compiled-scalar pragma" in str(findings[0])
    assert "non-empty reason" in findings[0].reason


def test_pragma_text_inside_a_string_is_ignored():
    source = _module(
        f"""
        DOC = "{PRAGMA}"


        @torch.compile
        def scaled(x: torch.Tensor, s: torch.Tensor):
            return x * s
        """
    )
    assert check_source(source) == []


# ---------------------------------------------------------------------------------------------
# Output, errors and the command line


def test_finding_format():
    finding = Finding("a/b.py", 12, "clamped", "c", "annotated 'float'; compiled via @jit_fuser")
    assert str(finding) == (
        "a/b.py:12: function 'clamped' parameter 'c' can carry a Python float into compiled code "
        "(annotated 'float'; compiled via @jit_fuser)"
    )


def test_syntax_error_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\n\n@torch.compile\ndef f(x, c: float:\n    return x\n")
    good = tmp_path / "good.py"
    good.write_text("x = 1\n")
    with pytest.raises(CheckError, match=r"broken\.py:4:\d+: cannot parse"):
        check_paths([tmp_path])
    with pytest.raises(CheckError, match=r"m\.py:1:\d+: cannot parse"):
        check_source("def (:\n", "m.py")

    result = _run_cli(str(tmp_path))
    assert result.returncode == 2, result
    assert "broken.py:4:" in result.stderr and "cannot parse" in result.stderr
    assert "Traceback" not in result.stderr
    assert "2 file(s) checked" in result.stdout


def test_missing_path_is_a_clear_error(tmp_path):
    result = _run_cli(str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "no such file or directory" in result.stderr and "Traceback" not in result.stderr


def test_cli_exit_codes(tmp_path):
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(_module("@jit_fuser\ndef f(x, c: float):\n    return x * c\n"))
    good = tmp_path / "good.py"
    good.write_text(_module("@jit_fuser\ndef f(x, c: torch.Tensor):\n    return x * c\n"))

    result = _run_cli(str(bad), cwd=tmp_path)
    assert result.returncode == 1, result
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"{bad}:{HEADER_LINES + 2}: function 'f' parameter 'c' can carry a Python float into "
        "compiled code (annotated 'float'; compiled via @jit_fuser)"
    )
    assert lines[-1].startswith("check_compiled_scalars: 1 compiled function(s) in 1 file(s)")

    result = _run_cli(str(good))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.strip() == (
        "check_compiled_scalars: 1 compiled function(s) in 1 file(s) checked, "
        "0 finding(s), 0 error(s)"
    )

    # A directory is searched recursively; paths are shown as given.
    result = _run_cli("pkg", "good.py", "--quiet", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"pkg/bad.py:{HEADER_LINES + 2}: function 'f' parameter 'c' can carry a Python float "
        "into compiled code (annotated 'float'; compiled via @jit_fuser)"
    ]
    assert _run_cli("good.py", "--quiet", cwd=tmp_path).stdout == ""


def test_repo_megatron_has_no_findings():
    """The CI gate: every compiled function in megatron/ takes no unguarded Python float."""
    findings = check_paths([REPO_ROOT / "megatron"])
    assert findings == [], "\n".join(map(str, findings))


def test_cli_default_path_is_repo_megatron():
    result = _run_cli(cwd=REPO_ROOT / "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiled function(s)" in result.stdout
