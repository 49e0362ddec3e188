"""docs/architecture.md stays true in what a test can check: it names every CLI subcommand, every
package of the distribution, and every module file it cites exists."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_cli_subcommand_is_named():
    from radix_backend.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    row = next(line for line in DOC.splitlines() if line.startswith("| `cli.py` |"))
    missing = [name for name in sub.choices if not re.search(rf"\b{re.escape(name)}\b", row)]
    assert not missing, f"docs/architecture.md's cli.py line lacks {missing}"


def test_every_package_is_named():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {p: p.removeprefix("radix_backend.").replace(".", "/") for p in packages if p != "radix_backend"}
    missing = [p for p, folder in folders.items() if f"{folder}/" not in DOC and f"`{p}`" not in DOC]
    assert not missing, f"docs/architecture.md names no {missing}"


def test_every_cited_module_exists():
    """Each `name.py` / `path/name.c` the doc cites is a file of the repository (rows name files
    relative to their section's folder, so a cited path matches the end of a real one)."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.suffix in (".py", ".c", ".h")
             and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    cited = set(re.findall(r"`([\w/]+\.(?:py|c|h))`", DOC))
    missing = [c for c in sorted(cited) if not any(f == c or f.endswith("/" + c) for f in files)]
    assert not missing, f"docs/architecture.md cites files that do not exist: {missing}"
