"""The layout states the architecture: each layer imports only the layers below it, and no module
imports itself back through others (lazy imports inside functions count too).

Layers, lowest first: launching; runtime; collectives, data, kfac; persistence; training; bench, demos, tools; the
entry modules at the package root (``python -m hpcdl.train`` ...).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {
    "launching": -1,  # the planner, under the runtime: world and placement read its rule for a host's cores
    "runtime": 0,
    "collectives": 1, "data": 1, "kfac": 1,
    "persistence": 2,
    "training": 3,
    "bench": 4, "demos": 4, "tools": 4,
    "<entry>": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to; None for anything outside hpcdl and kfac."""
    parts = module.split(".")
    if parts[0] == "kfac":
        return "kfac"
    if parts[0] != "hpcdl":
        return None
    if len(parts) == 1:
        return "<entry>"
    return parts[1] if parts[1] in LAYERS else "<entry>"


def package_modules() -> dict[str, Path]:
    files = [*REPO.joinpath("hpcdl").rglob("*.py"), *REPO.joinpath("kfac").rglob("*.py")]
    return {module_name(path): path for path in files}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Modules of hpcdl/kfac that ``path`` imports, anywhere in the file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(path, known) - {name} for name, path in modules.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in edges.items():
        for target in targets:
            a, b = layer_of(source), layer_of(target)
            assert a is not None and b is not None
            # a package's own __init__ re-exports its modules; any other import must go strictly down
            if a != b and LAYERS[b] >= LAYERS[a]:
                wrong.append(f"{source} ({a}) imports {target} ({b})")
    return sorted(wrong)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None. Package __init__ files that re-export their
    own modules are not edges back into the package."""
    def real(source: str, target: str) -> bool:
        return not source.startswith(target + ".")

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if not real(node, nxt):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_module_belongs_to_a_known_layer() -> None:
    for name in package_modules():
        parts = name.split(".")
        if parts[0] == "hpcdl" and len(parts) > 2:
            assert parts[1] in LAYERS, f"{name} is in no layer; add its package to LAYERS and README's layout"


def readme_layout() -> str:
    text = REPO.joinpath("README.md").read_text()
    section = text[text.index("## Layout"):]
    return section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section


def test_readme_layout_names_what_exists() -> None:
    """Every folder README's Layout names exists, every layer is in it, and so is every module of the run,
    runtime and training layers (whose module names carry the architecture)."""
    layout = readme_layout()
    named = set(re.findall(r"(?<![\w/.])((?:hpcdl|kfac|benchmarks|launch|scripts|tests)/[\w/.]*)", layout))
    assert named, "the Layout section names no paths"
    missing = [path for path in named if not REPO.joinpath(path).exists()]
    assert missing == []
    for layer in LAYERS:
        if layer not in ("<entry>", "kfac"):
            assert f"hpcdl/{layer}/" in layout, f"README's Layout does not name hpcdl/{layer}/"
    for layer in ("launching", "runtime", "persistence", "training"):
        for module in REPO.joinpath("hpcdl", layer).glob("*.py"):
            if module.stem != "__init__":
                assert re.search(rf"\b{module.stem}\b", layout), f"README's Layout does not name hpcdl/{layer}/{module.name}"


def test_layers_import_only_downward() -> None:
    assert upward_imports(graph()) == []


def test_no_import_cycle() -> None:
    assert find_cycle(graph()) is None


@pytest.mark.parametrize("edges, expected", [
    ({"hpcdl.runtime.world": {"hpcdl.persistence.checkpoint_files"}, "hpcdl.persistence.checkpoint_files": set()},
     ["hpcdl.runtime.world (runtime) imports hpcdl.persistence.checkpoint_files (persistence)"]),
    ({"hpcdl.data.spec": {"hpcdl.collectives.ring"}, "hpcdl.collectives.ring": set()},
     ["hpcdl.data.spec (data) imports hpcdl.collectives.ring (collectives)"]),
    ({"hpcdl.training.job": {"hpcdl.persistence.checkpoint_files"}, "hpcdl.persistence.checkpoint_files": set()}, []),
])
def test_the_layer_check_catches_an_upward_or_sideways_import(edges, expected) -> None:
    assert upward_imports(edges) == expected


def test_the_cycle_check_catches_a_cycle() -> None:
    edges = {"hpcdl.training.job": {"hpcdl.training.runstate"}, "hpcdl.training.runstate": {"hpcdl.training.job"}}
    assert find_cycle(edges) == ["hpcdl.training.job", "hpcdl.training.runstate", "hpcdl.training.job"]
    assert find_cycle({"hpcdl.data": {"hpcdl.data.spec"}, "hpcdl.data.spec": {"hpcdl.data"}}) is None


def test_kfac_imports_nothing_from_hpcdl() -> None:
    """kfac/ is a library that stands alone, as kfac-pytorch's preconditioner does: hpcdl uses it, never the reverse."""
    edges = graph()
    wrong = sorted(f"{source} imports {target}" for source, targets in edges.items() if source.startswith("kfac")
                   for target in targets if target.startswith("hpcdl"))
    assert wrong == []


@pytest.mark.processes
def test_kfac_works_with_hpcdl_absent() -> None:
    """In a Python that cannot import hpcdl at all, every kfac module imports and a preconditioned step equals the
    dense solve (G ⊗ A + λI)⁻¹ g of the same factors."""
    import subprocess
    import sys

    code = '''
import importlib, pkgutil, sys
class NoHpcdl:
    def find_spec(self, name, path=None, target=None):
        if name == "hpcdl" or name.startswith("hpcdl."):
            raise ImportError("hpcdl is absent in this test")
sys.meta_path.insert(0, NoHpcdl())
import kfac, torch
for info in pkgutil.iter_modules(kfac.__path__):
    importlib.import_module(f"kfac.{info.name}")
torch.manual_seed(0)
layer = torch.nn.Linear(3, 2, dtype=torch.float64)
pre = kfac.KFACPreconditioner(layer, inv_update_freq=1, kl_clip=None, damping=0.1, factor_decay=0.5)
x = torch.randn(5, 3, dtype=torch.float64)
torch.nn.functional.mse_loss(layer(x), torch.zeros(5, 2, dtype=torch.float64)).backward()
raw = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).clone()
pre.step()
a, g = pre.a_factors[0], pre.g_factors[0]
want = torch.linalg.solve(torch.kron(g, a) + 0.1 * torch.eye(8, dtype=torch.float64), raw.reshape(-1)).reshape(2, 4)
got = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
assert "hpcdl" not in sys.modules and torch.allclose(got, want, rtol=1e-8, atol=1e-10), (got, want)
print("ok")
'''
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
