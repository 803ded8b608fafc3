"""The package's modules import one another in one direction: no cycle, not even through an import
placed inside a function (the usual way a cycle is hidden). Reads every module's source, so the test
needs nothing imported."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rdkv": ROOT / "rdkv", "rdkv.methods": ROOT / "rdkv" / "methods", "rdkv.solvers": ROOT / "solvers",
            "rdkv.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file, ``if TYPE_CHECKING:`` blocks excepted."""
    pkg = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in known and m != name}


def test_no_import_cycle_inside_the_package():
    mods = modules()
    graph = {name: imports(name, path, set(mods)) for name, path in mods.items()}
    assert graph["rdkv.api"] and "rdkv.dense" in graph["rdkv.attention"]  # the parser sees imports
    assert "rdkv.errors" in graph["rdkv.methods.base"] and "rdkv.methods.base" in graph["rdkv.methods"]
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state and m != "rdkv":  # the package's __init__ imports its public modules
            visit(m, [m])


def test_the_triton_dispatch_table_names_real_kernels():
    """rdkv.backend looks each step's Triton kernel up by name (so that no import cycle runs through the kernels,
    which import what dispatches to them): every entry must name a function its kernels module defines."""
    from rdkv.backend import TRITON_KERNELS

    for step, (module, name) in TRITON_KERNELS.items():
        tree = ast.parse((ROOT / "kernels" / f"{module}.py").read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in defined, (step, module, name)
