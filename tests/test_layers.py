"""runtime/ is a stack of floors, and the public API sits on top of them.

- ops: what runs inside a training step;
- models: the built-in models, configs and the batch forms;
- methods: the compression methods, what they target, and their registry;
- apply: a policy applied to a model (policy, trace, compress, accounting);
- calibration: gradient statistics and per-layer tables on the user's batches;
- memory: reasoning about a whole step (estimate, profile, the planner).

An import stays on its floor or goes down, never up; the graph of imports between runtime's
modules, those made inside functions included, has no cycle; and the names users import from
`actdesign.runtime` are the ones each floor defines.
"""

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
FLOORS = ("ops", "models", "methods", "apply", "calibration", "memory")  # bottom to top


def module_name(path: Path) -> str:
    parts = path.relative_to(RUNTIME).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("actdesign", "runtime", *parts))


MODULES = {module_name(p): p for p in RUNTIME.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The runtime modules `name` imports, anywhere in its file."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from package import module` imports the module (a package's __init__ runs
            # before any of its modules anyway); `from module import name` the module
            candidates = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target
                          for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found.update(c for c in candidates if c in MODULES and c != name)
    return found


def floor_of(name: str) -> int | None:
    parts = name.split(".")
    return FLOORS.index(parts[2]) if len(parts) > 2 and parts[2] in FLOORS else None


def test_every_module_but_the_public_api_is_on_a_floor():
    homeless = [n for n in MODULES if floor_of(n) is None and n != "actdesign.runtime"]
    assert homeless == []


@pytest.mark.parametrize("name", sorted(n for n in MODULES if floor_of(n) is not None))
def test_imports_never_run_up_a_floor(name):
    up = [m for m in imports_of(name) if floor_of(m) is None or floor_of(m) > floor_of(name)]
    assert up == [], f"{name} imports from above its floor"


def test_the_imports_have_no_cycle():
    graph = {name: imports_of(name) for name in MODULES}
    done, path = set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for other in sorted(graph[name]):
            visit(other)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_ops_import_nothing_from_the_floors_above():
    ops = [n for n in MODULES if floor_of(n) == 0]
    assert len(ops) > 10
    for name in ops:
        assert all(floor_of(m) == 0 for m in imports_of(name)), name


# What users import from actdesign.runtime, and the module that defines each.
PUBLIC = {
    "compress": "apply.compress", "Report": "apply.compress", "Policy": "apply.policy",
    "load_policy": "apply.policy", "account": "apply.accounting",
    "SavedBytes": "apply.accounting", "estimate": "memory.estimate",
    "Estimate": "memory.results", "calibrate": "calibration.bits",
    "calibrate_policy": "calibration.policy", "load": "ops.cache",
    "load_source": "ops.cache", "cache_dir": "ops.cache", "LeanLinear": "ops.compressed",
    "fused_linear_cross_entropy": "ops.lm_loss", "MSLayerNorm": "ops.norms",
    "MSRMSNorm": "ops.norms", "QMSLayerNorm": "ops.norms", "QMSRMSNorm": "ops.norms",
    "ms_norm": "ops.norms", "norm_ops": "ops.norms", "PooledConv2d": "ops.pooled_conv",
    "QLinear": "ops.quantized", "QConv2d": "ops.quantized", "qlinear": "ops.quantized",
    "qconv2d": "ops.quantized", "actnn_ops": "ops.quantized", "SparseLinear": "ops.sparse",
    "SparseConv2d": "ops.sparse",
}


def test_the_public_api_stays_where_users_import_it():
    import actdesign.runtime as runtime

    assert set(runtime.__all__) == set(PUBLIC) | {"plan", "models"}
    for name, home in PUBLIC.items():
        assert getattr(runtime, name).__module__ == f"actdesign.runtime.{home}", name
    assert runtime.models.__name__ == "actdesign.runtime.models"
    assert callable(runtime.plan) and runtime.plan.__module__ == "actdesign.runtime"
