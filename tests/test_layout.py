"""The package layout holds: wings over a ground, imports one way, no circles, docstring-only __init__ files, helper
CLIs that load no torch, and product files under the size a reader takes in (docs/layout.md explains the rules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = REPO_ROOT / "fsdp_lib"
# Higher imports lower, never the other way; wings of one rank do not import each other.
WING_RANK = {"records": 1, "convert": 2, "organize": 2, "data": 2, "model": 3, "hub": 4, "train": 4}
GROUND_RANK = 0
TOOLS = ("fsdp_train", "data_hf", "model_download", "organize_data")
TORCH_FREE = ("data_hf", "model_download", "organize_data", "fsdp_lib.records", "fsdp_lib.convert", "fsdp_lib.hub")
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str], module_level_only: bool = False) -> set[str]:
    """The project modules `path` imports (fsdp_lib.* and the tools), resolved to the modules that exist."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            if name in known or name.split(".")[0] in TOOLS:
                found.add(name)
    return found


def rank_of(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and parts[1] in WING_RANK):
        return WING_RANK[parts[1]], parts[1]
    return GROUND_RANK, "ground"


def test_every_module_sits_in_a_known_wing_or_on_the_ground():
    wings = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert wings == set(WING_RANK), f"wings on disk {sorted(wings)} vs ranks known {sorted(WING_RANK)}"


def test_imports_run_one_way():
    modules = package_modules()
    known = set(modules)
    upward = []
    for name, path in modules.items():
        rank, wing = rank_of(name)
        for target in imported_modules(path, known):
            if target.split(".")[0] in TOOLS:
                upward.append(f"{name} imports the tool {target}")
                continue
            target_rank, target_wing = rank_of(target)
            if target_rank > rank or (target_rank == rank and wing != "ground" and target_wing != wing):
                upward.append(f"{name} ({wing}) imports {target} ({target_wing})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_circles():
    modules = package_modules()
    known = set(modules)
    graph = {name: {t for t in imported_modules(path, known) if t in known} for name, path in modules.items()}
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:  # on the current path: a circle
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_wing_init_files_hold_only_a_docstring():
    for init in sorted(PACKAGE.glob("*/__init__.py")) + [PACKAGE / "__init__.py"]:
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), (
            f"{init.relative_to(REPO_ROOT)}: a docstring and nothing else (a re-export would drag torch into the tools)"
        )


def test_helper_tools_and_their_wings_load_no_torch():
    modules = [m for m in package_modules() if m.startswith(TORCH_FREE)] + list(TORCH_FREE[:3])
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {modules} loaded torch: {out.stdout}"


def test_product_files_stay_readable_in_one_sitting():
    files = [*PACKAGE.rglob("*.py"), *REPO_ROOT.glob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")]
    long = {str(p.relative_to(REPO_ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by responsibility): {long}"
