"""Layer math is single-device: no module under moe_dist/layers or moe_dist/models imports moe_dist.parallel. The
seams a layer receives (the MoE dispatcher, the context-parallel exchange) are interfaces defined in layers/ whose
collectives live in parallel/; this test reads the sources (ast), so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moe_dist"
FORBIDDEN = "moe_dist.parallel"


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> set[str]:
    """Every module the source file `path` (under the import root `root`) imports, absolute: relative imports
    resolved, and `from a import b` counts both a and a.b, since b may be a submodule."""
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _layer_and_model_files() -> list[Path]:
    return sorted(p for sub in ("layers", "models") for p in (PACKAGE / sub).rglob("*.py"))


@pytest.mark.parametrize("path", _layer_and_model_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_and_models_import_nothing_from_parallel(path):
    bad = sorted(m for m in imported_modules(path) if m == FORBIDDEN or m.startswith(FORBIDDEN + "."))
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {bad}: take the seam as an argument instead"


def test_the_check_sees_absolute_relative_and_nested_imports(tmp_path):
    """The parser catches each way of writing the import (guards the test above against passing vacuously)."""
    layers = tmp_path / "moe_dist" / "layers"
    layers.mkdir(parents=True)
    source = (
        "import moe_dist.parallel.comm\n"
        "from moe_dist import parallel\n"
        "from ..parallel.mesh import Mesh\n"
        "def f():\n"
        "    from moe_dist.parallel import dispatch\n"
    )
    (layers / "x.py").write_text(source)
    found = imported_modules(layers / "x.py", root=tmp_path)
    assert {
        "moe_dist.parallel.comm",
        "moe_dist.parallel",
        "moe_dist.parallel.mesh",
        "moe_dist.parallel.dispatch",
    } <= found
