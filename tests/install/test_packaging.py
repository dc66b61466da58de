"""The wheel ships every package of the tree: pyproject's explicit list (needed for the
``specbatch_kernels`` / ``specbatch_migrations`` source roots) names each folder with an
``__init__.py`` (a missing subpackage once left a wheel's ``specbatch`` unable to import its CLI)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_pyprojects_list():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / path for name, path in config.get("package-dir", {}).items()}
    found = set()
    for top in ("engine", "worker"):
        found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / top).rglob("__init__.py")}
    for name, path in roots.items():
        found |= {".".join((name, *p.parent.relative_to(path).parts)) for p in path.rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml's packages miss {sorted(found - listed)}"
