"""Packaging: the top-level folders kernels/, lang/, adapters/ ship and import as radix_backend.kernels,
radix_backend.lang and radix_backend.adapters (setuptools package-dir), from a wheel and from an
editable install alike, and never as top-level `kernels` / `lang` / `adapters`.

Builds run on a copy of the source tree, so the checkout gets no build/ or *.egg-info. The fresh
venvs see the running interpreter's site-packages through a .pth file (torch etc. need not be
installed again) but not its radix-backend install, which the tests check by file location.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds a wheel and two venvs: ~30-60 s on a busy 2-core box

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"kernels": "radix_backend.kernels", "lang": "radix_backend.lang", "adapters": "radix_backend.adapters"}
SOURCE_DIRS = {"radix_backend": "radix_backend", **{folder: f"radix_backend/{folder}" for folder in MAPPED}}
NOT_TOP_LEVEL = ("kernels", "lang", "adapters", "tests", "examples")
TIMEOUT = 600


def present_folders() -> list[str]:
    """Mapped folders that are packages in this checkout (others may still be being written)."""
    return [folder for folder in MAPPED if (REPO / folder / "__init__.py").is_file()]


def run(cmd: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def copy_source(dest: Path) -> Path:
    """The files git would commit (tracked + untracked, not ignored); a plain filtered copy without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                                check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                    "__pycache__", ".pytest_cache", ".hypothesis"))
        return dest
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def fresh_venv(path: Path) -> Path:
    """A venv without pip that sees this interpreter's site-packages (after its own)."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)], cwd=path.parent)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       cwd=path.parent).stdout.strip())
    parents = [p for p in {*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
               if Path(p).is_dir()]
    (purelib / "_parent_env.pth").write_text("\n".join(sorted(parents)) + "\n")
    return python


def pip_into(python: Path, *args: str, cwd: Path) -> None:
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-build-isolation",
         "-q", *args], cwd=cwd)


PROBE = textwrap.dedent("""
    import importlib, importlib.util, json, sys
    out = {}
    for name in sys.argv[1:]:
        out[name] = importlib.import_module(name).__file__
    for name in ("kernels", "lang", "adapters"):
        spec = importlib.util.find_spec(name)
        out["top:" + name] = None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))
    print(json.dumps(out))
""")


def probe(python: Path, cwd: Path, modules: list[str]) -> dict[str, str | None]:
    return json.loads(run([str(python), "-c", PROBE, *modules], cwd=cwd).stdout.strip().splitlines()[-1])


def assert_not_ours(found: dict[str, str | None], roots: list[Path]) -> None:
    """The top-level names resolve to no folder of ours (a checkout's or an installed copy's): they
    are absent, or another distribution's (transformers >= 5.25 requires `kernels`, which then sits
    in the same site-packages as our wheel)."""
    for name in ("kernels", "lang", "adapters"):
        origin = found["top:" + name]
        if origin is None:
            continue
        path = Path(origin).resolve()
        ours = "radix_backend" in path.parts or any(path.is_relative_to(root.resolve() / name) for root in roots)
        assert not ours, f"`import {name}` resolves to our folder: {origin}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_source(tmp_path_factory.mktemp("src") / "radix-backend")


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        cwd=out)
    wheels = sorted(out.glob("radix_backend-*.whl"))
    assert len(wheels) == 1, f"expected one radix_backend wheel, got {[w.name for w in out.iterdir()]}"
    return wheels[0]


def test_mapped_folders_exist() -> None:
    assert "kernels" in present_folders(), "kernels/__init__.py is missing"
    missing = sorted(set(MAPPED) - set(present_folders()))
    assert not missing, f"package folders without __init__.py: {missing}"


def test_wheel_layout(wheel: Path, source: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/", 1)[0] for name in names}
    assert not top_level & set(NOT_TOP_LEVEL), f"wheel ships top-level folders {sorted(top_level & set(NOT_TOP_LEVEL))}"
    for folder in present_folders():
        assert f"radix_backend/{folder}/__init__.py" in names
    # Every module of the source tree ships at its mapped place (catches subpackages missing from
    # pyproject's `packages` list).
    missing = []
    for src_dir, dest in SOURCE_DIRS.items():
        for py in sorted((source / src_dir).rglob("*.py")):
            rel = py.relative_to(source / src_dir).as_posix()
            if f"{dest}/{rel}" not in names:
                missing.append(f"{src_dir}/{rel}")
    assert not missing, f"source modules missing from the wheel (add their packages to pyproject): {missing}"
    # data files the code reads at run time
    for c_file in ("cpu_kernels.c", "cpu_kernels.h", "decode_stack.c", "moe.c", "moe.h", "q8_matmul.c", "q16.h",
                   "thread_pool.c", "thread_pool.h"):
        assert f"radix_backend/kernels/csrc/{c_file}" in names, f"the native kernels' C source {c_file} is not packaged"


def test_console_script_target_is_packaged(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry).decode())
    target = parser["console_scripts"]["radix-backend"]
    module = target.split(":", 1)[0]
    assert module.replace(".", "/") + ".py" in names, f"console script target {target} is not in the wheel"


def test_wheel_install_imports_from_outside_repo(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    pip_into(python, str(wheel), cwd=tmp_path)
    modules = ["radix_backend", *(MAPPED[f] for f in present_folders())]
    found = probe(python, tmp_path, modules)
    venv = (tmp_path / "venv").resolve()
    for name in modules:
        assert found[name] and Path(found[name]).resolve().is_relative_to(venv), \
            f"{name} imported from {found[name]}, not from the wheel installed in {venv}"
    for folder in present_folders():
        assert Path(found[MAPPED[folder]]).parent.name == folder and Path(found[MAPPED[folder]]).parent.parent.name \
            == "radix_backend"
    assert_not_ours(found, [REPO, venv])


def test_editable_install_imports_from_another_cwd(source: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    pip_into(python, "-e", str(source), cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    modules = ["radix_backend", *(MAPPED[f] for f in present_folders())]
    found = probe(python, elsewhere, modules)
    for folder in present_folders():
        origin = Path(found[MAPPED[folder]]).resolve()
        assert origin == (source / folder / "__init__.py").resolve(), \
            f"{MAPPED[folder]} imported from {origin}, expected the editable source {source / folder}"
    assert Path(found["radix_backend"]).resolve() == (source / "radix_backend" / "__init__.py").resolve()
    assert_not_ours(found, [REPO, source])


def test_a_checkout_on_sys_path_does_not_shadow_the_kernels_distribution() -> None:
    """`python -m pytest` (or any `python -m`) from the checkout puts its root first on sys.path,
    where the source folder `kernels/` would pass for the `kernels` distribution transformers
    imports (a required dependency from transformers 5.25 on). A model config loads from there
    (transformers probes or imports `kernels` on the way), `import kernels` gives the distribution
    when it is installed, and radix_backend.kernels stays ours."""
    code = textwrap.dedent("""
        import importlib.metadata, json
        import transformers
        transformers.LlamaConfig()  # imports transformers.integrations.hub_kernels, which probes `kernels`
        try:
            importlib.metadata.distribution("kernels")
            installed = True
        except importlib.metadata.PackageNotFoundError:
            installed = False
        found = None
        if installed:
            import kernels
            found = kernels.__file__
        import radix_backend.kernels as ours
        print(json.dumps([found, installed, ours.__name__, hasattr(ours, "create_attention_backend")]))
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found, installed, ours, complete = json.loads(result.stdout.strip().splitlines()[-1])
    assert (found is not None) == installed
    assert found is None or not Path(found).resolve().is_relative_to(REPO / "kernels")
    assert ours == "radix_backend.kernels" and complete
