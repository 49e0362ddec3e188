"""Guidance's own model-integration tests (tests/model_integration of the installed guidance
version's source) run against `RadixGuidance` on SmolLM2, in a pytest subprocess.

guidance's PyPI sdist ships no tests, so the source comes from a guidance git checkout or bare
repository named by $RADIX_GUIDANCE_SOURCE (the tag equal to the installed version is exported);
without it the test skips and says so. Guidance's conftest.py is replaced by
tests/adapters/guidance_upstream/conftest_radix.py, whose `selected_model` fixture is our adapter; the
tests themselves run unchanged. Content failures of the 135M model are xfailed there, with reasons.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("guidance")

HERE = Path(__file__).parent
SOURCE_ENV = "RADIX_GUIDANCE_SOURCE"
MIN_PASSED = 40  # guidance 0.3.1 has 44 model-integration tests once its Hub-only tokenizer tests are set aside


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0


def guidance_tests(source: Path, version: str, dest: Path) -> Path:
    """Guidance's `tests/` tree for `version` under `dest` (copied from a checkout, or exported
    from a git repository at the tag named like the version)."""
    if (source / "tests" / "model_integration").is_dir():
        shutil.copytree(source / "tests", dest / "tests")
        return dest / "tests"
    archive = dest / "tests.tar"
    subprocess.run(["git", f"--git-dir={source}", "archive", "-o", str(archive), version, "tests"], check=True,
                   capture_output=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest / "tests"


def junit_counts(path: Path) -> Counts:
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if case.find("failure") is not None:
            counts.failed += 1
        elif case.find("error") is not None:
            counts.errors += 1
        elif skipped is not None:
            if skipped.get("type") == "pytest.xfail":
                counts.xfailed += 1
            else:
                counts.skipped += 1
        else:
            counts.passed += 1
    return counts


@pytest.mark.slow
def test_guidance_model_integration_suite(tmp_path: Path) -> None:
    source = os.environ.get(SOURCE_ENV)
    if not source:
        pytest.skip(f"guidance's PyPI sdist ships no tests: set {SOURCE_ENV} to a guidance-ai/guidance git "
                    "checkout or repository (with the installed version's tag) to run its model-integration tests")
    version = importlib.metadata.version("guidance")
    tests_dir = guidance_tests(Path(source), version, tmp_path)
    shutil.copy(HERE / "guidance_upstream" / "conftest_radix.py", tests_dir / "conftest.py")
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEsxX", "-p", "no:cacheprovider", f"--junitxml={junit}",
         "tests/model_integration"],
        cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    counts = junit_counts(junit)
    print(f"guidance {version} model_integration on RadixGuidance: {counts}")
    assert counts.failed == 0 and counts.errors == 0, proc.stdout[-6000:]
    assert counts.passed >= MIN_PASSED, proc.stdout[-6000:]
