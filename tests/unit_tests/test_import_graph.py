"""The project's modules import one another without a cycle, and the ladders point down.

The graph is drawn from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` of a module of ``megatron/`` or ``mcore_activations/``, at any depth of the
file, function-local ones included (a local import hides a cycle, it does not remove it). The
ladders leave out imports under ``if TYPE_CHECKING:`` (they never run); the whole repository's
graph, ``tools/`` and ``tests/`` included, keeps them: a circle drawn only for the type checker
still ties two modules that cannot be read one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron", "mcore_activations")
REPO_PACKAGES = (*PACKAGES, "tools", "tests")


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``packages``."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _runtime_nodes(tree: ast.AST, type_checking: bool = False):
    """Every node of ``tree``; without ``type_checking``, none under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                not type_checking
                and isinstance(child, ast.If)
                and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(files: dict[str, Path], type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name imported from a package counts as the
    submodule of that name when there is one, else as the package); with ``type_checking``, the
    imports under ``if TYPE_CHECKING:`` too."""

    def owner(name: str):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets.update(owner(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else owner(base))
        targets.discard(None)
        targets.discard(module)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


GRAPH = import_graph(module_files())


def test_no_import_cycle():
    found = [sorted(c) for c in cycles(GRAPH)]
    assert not found, f"import cycles among the project's modules: {found}"


def test_no_import_cycle_in_the_repository_even_for_the_type_checker():
    graph = import_graph(module_files(ROOT, REPO_PACKAGES), type_checking=True)
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles in the repository (TYPE_CHECKING included): {found}"


# The activation ladder (docs/activations.md) and the parallel-state one (parallel_state.py's
# docstring): each rung imports only the project modules listed.
LADDER = {
    "mcore_activations.kernel_params": set(),
    "mcore_activations.versions": set(),
    "mcore_activations.jit": {"mcore_activations.versions"},
    "mcore_activations.te_import": set(),
    "mcore_activations.activations": {
        "mcore_activations.jit",
        "mcore_activations.kernel_params",
    },
    "mcore_activations.activation_spec": {"mcore_activations.activations"},
    "megatron.core.tensor_parallel.random": {
        "megatron.core.parallel_state",
        "megatron.core.tensor_parallel.utils",
        "megatron.core.utils",
        "megatron.core.extensions.te_rng",
        "megatron.core.tensor_parallel.checkpoint_autograd",
        "megatron.core.tensor_parallel.checkpoint_fp8",
        "megatron.core.tensor_parallel.rng_state",
        "mcore_activations.te_import",
    },
    "megatron.core.tensor_parallel.rng_state": set(),
    "megatron.core.tensor_parallel.checkpoint_autograd": set(),
    "megatron.core.tensor_parallel.checkpoint_fp8": {"mcore_activations.te_import"},
    "megatron.core.tensor_parallel.cross_entropy": {
        "megatron.core.parallel_state",
        "megatron.core.tensor_parallel.utils",
        "megatron.core.utils",
    },
    "megatron.core.tensor_parallel.data": {"megatron.core.utils"},
    "megatron.core.parallel_layout": set(),
    "megatron.core.parallel_state_store": set(),
    "megatron.core.parallel_state_ranks": {"megatron.core.parallel_state_store"},
    "megatron.core.parallel_state_groups": {
        "megatron.core.parallel_state_ranks",
        "megatron.core.parallel_state_store",
    },
}


@pytest.mark.parametrize("module", sorted(LADDER))
def test_ladder_rung_imports_only_below(module):
    extra = GRAPH[module] - LADDER[module]
    assert not extra, f"{module} imports {sorted(extra)}, above it on the ladder"


# The floors of mcore_activations/, bottom first (docs/activations.md): a module imports only
# modules of its own floor or below. A module not named takes the floor of its package prefix.
FLOORS = (
    # leaves: the compile boundary, version and environment readers, data, the audits' words
    {
        "mcore_activations.kernel_params",
        "mcore_activations.versions",
        "mcore_activations.patch_env",
        "mcore_activations.upstream_fingerprints",
        "mcore_activations.audit_cells",
        "mcore_activations.audit_cli",
        "mcore_activations.audit_config",
    },
    {"mcore_activations.jit"},
    {"mcore_activations.activations"},
    {"mcore_activations.activation_spec"},
    # one floor up from the spec: the TE seam and every lowering of a spec (kernels, TE ops,
    # the float64 reference MLP), and the audits' catalogue and runner, which read specs
    {
        "mcore_activations.te_import",
        "mcore_activations.te_lowering",
        "mcore_activations.reference_mlp",
        "mcore_activations.activation_catalogue",
        "mcore_activations.audit_runner",
        "mcore_activations.fusions.activation_kernels",
        "mcore_activations.fusions.triton_jit",
        "mcore_activations.fusions.triton_plans",
        "mcore_activations.fusions.triton_kernels",
    },
    {"mcore_activations.fusions."},  # the ops, the autograd Function, upstream's entry points
    {"mcore_activations.activation_path"},
    {"mcore_activations.upstream_patch."},
    {"mcore_activations.megatron_patch"},
    {
        "mcore_activations.autopatch",
        "mcore_activations._startup",
        "mcore_activations.upstream_audit",
    },
    {"mcore_activations"},  # the package: imports the patch on request
)


def floor_of(module: str) -> int:
    """The floor of an ``mcore_activations`` module: by its name, else by its package prefix."""
    for floor, names in enumerate(FLOORS):
        if module in names:
            return floor
    for floor, names in enumerate(FLOORS):
        if any(name.endswith(".") and f"{module}.".startswith(name) for name in names):
            return floor
    raise AssertionError(f"{module} has no floor in FLOORS: place it on the ladder")


def test_mcore_activations_imports_point_down():
    upward = [
        f"{module} -> {target}"
        for module, targets in sorted(GRAPH.items())
        if module.startswith("mcore_activations")
        for target in sorted(targets)
        if target.startswith("mcore_activations") and floor_of(target) > floor_of(module)
    ]
    assert not upward, f"imports running back up the mcore_activations ladder: {upward}"


def test_graph_sees_local_imports(tmp_path):
    # Teeth: a cycle closed only by a function-local import is found; a TYPE_CHECKING one is not.
    (tmp_path / "megatron").mkdir()
    (tmp_path / "mcore_activations").mkdir()
    (tmp_path / "megatron" / "a.py").write_text("import megatron.b\n")
    (tmp_path / "megatron" / "b.py").write_text("def f():\n    from megatron import a\n")
    (tmp_path / "megatron" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megatron.a\n"
    )
    (tmp_path / "megatron" / "d.py").write_text("from . import c\n")
    graph = import_graph(module_files(tmp_path))
    assert cycles(graph) == [frozenset({"megatron.a", "megatron.b"})]
    assert graph["megatron.c"] == set()
    assert graph["megatron.d"] == {"megatron.c"}
    # The whole-repository graph keeps the type checker's imports.
    assert import_graph(module_files(tmp_path), type_checking=True)["megatron.c"] == {"megatron.a"}


def test_floors_place_every_module_and_packages_by_prefix():
    assert floor_of("mcore_activations.fusions") == floor_of("mcore_activations.fusions.in_place")
    assert floor_of("mcore_activations.fusions.activation_kernels") < floor_of(
        "mcore_activations.fusions.fused_activation"
    )
    assert floor_of("mcore_activations.te_import") > floor_of("mcore_activations.activation_spec")
    with pytest.raises(AssertionError, match="no floor"):
        floor_of("mcore_activations.somewhere_new")
