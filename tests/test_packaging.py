"""The built wheel (`pip install .`) holds every module of the source tree and nothing top-level besides moe_dist:
built from a copy of the tree (no build/ or egg-info left in the repository), unpacked, and every module imported
from the unpacked copy alone, in a fresh interpreter started elsewhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _source_modules() -> set[str]:
    """Dotted names of every module in the source tree: moe_dist/ and kernels/ (installed as moe_dist.kernels)."""
    names = set()
    for path in (REPO / "moe_dist").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[1] == "kernels" or "__pycache__" in parts:  # a checkout's moe_dist/kernels link to kernels/
            continue
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for path in (REPO / "kernels").glob("*.py"):
        names.add("moe_dist.kernels" if path.stem == "__init__" else f"moe_dist.kernels.{path.stem}")
    return names


@pytest.mark.timeout(600)
def test_wheel_holds_and_imports_every_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)

    def ignore(folder: str, names: list[str]) -> set[str]:  # moe_dist/kernels: a checkout's link, not a source
        return {"__pycache__"} | ({"kernels"} if Path(folder) == REPO / "moe_dist" else set())

    shutil.copytree(REPO / "moe_dist", src / "moe_dist", ignore=ignore)
    shutil.copytree(REPO / "kernels", src / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=src,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("moe_dist-*.whl")
    with zipfile.ZipFile(wheel) as z:
        files = z.namelist()
        z.extractall(tmp_path / "site")
    tops = {f.split("/")[0] for f in files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"moe_dist"}, tops  # no top-level `kernels`
    in_wheel = {
        f[:-3].replace("/", ".").removesuffix(".__init__") for f in files if f.endswith(".py")
    }  # fmt: skip
    expected = _source_modules()
    assert expected - in_wheel == set(), "modules missing from the wheel"
    assert "moe_dist.hf" in expected and "moe_dist.kernels.reference" in expected

    # -I: no PYTHONPATH, user site or current directory; the unpacked wheel goes first on sys.path.
    script = (
        "import importlib, json, sys\n"
        f"sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
        "out = {}\n"
        f"for name in {sorted(expected)!r}:\n"
        "    try:\n"
        "        out[name] = importlib.import_module(name).__file__\n"
        "    except Exception as e:\n"
        "        out[name] = f'error: {type(e).__name__}: {e}'\n"
        "print(json.dumps(out))\n"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=500
    )
    assert run.returncode == 0, run.stderr
    files_of = json.loads(run.stdout.strip().splitlines()[-1])
    site = str(tmp_path / "site")
    bad = {name: f for name, f in files_of.items() if not f.startswith(site)}
    assert bad == {}, "modules that did not import from the wheel"
