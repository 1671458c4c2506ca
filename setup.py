"""The packages a built wheel holds, found rather than listed (pyproject.toml holds everything else): every package
under moe_dist/, and moe_dist.kernels, whose sources are the top-level kernels/ (pyproject.toml's package-dir).
`kernels` itself is never installed top-level: an unrelated PyPI package has that name. A setup.py because
pyproject's `packages.find` only walks directories, and kernels/ is not under moe_dist/. tests/test_packaging.py
builds the wheel and imports every module from it."""

from setuptools import find_packages, setup

packages = find_packages(include=["moe_dist", "moe_dist.*"], exclude=["moe_dist.kernels", "moe_dist.kernels.*"])
setup(packages=[*packages, "moe_dist.kernels"])
