"""The installed project: its top-level import names are its own, and what it ships is complete.

transformers 5.25 requires Hugging Face's `kernels` distribution and imports it (`from kernels
import ...`) whenever it is installed; a project package named `kernels` shadowed it and broke
every import of transformers (and so of peft). These checks read pyproject.toml and the
installed distributions' metadata, so they fail for the next such name, not just that one.
constraints.txt pins what `make install` installs: the test environment must be that set.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "raylora"


def _setuptools() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


@pytest.mark.timeout(60)
def test_no_top_level_name_is_another_distributions() -> None:
    owners = importlib.metadata.packages_distributions()
    ours = {name for name, dists in owners.items() if DIST in dists}
    assert {"engine", "raylora_kernels", "deployments", "cluster", "serve_app"} <= ours
    clashes = {
        name: sorted(set(owners[name]) - {DIST}) for name in ours if set(owners[name]) - {DIST}
    }
    assert not clashes, f"import names another installed distribution also provides: {clashes}"


@pytest.mark.timeout(60)
def test_the_environment_is_the_locked_one() -> None:
    """Every distribution constraints.txt pins is installed at that version (`make install`
    installs with -c constraints.txt; a hand-upgraded package shows here, not as a mystery)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[name.strip()] = version.strip()
    assert "torch" not in pins and "transformers" in pins
    wrong = {}
    for name, version in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        if installed != version:
            wrong[name] = (installed, version)
    assert not wrong, f"installed (installed, pinned) differs from constraints.txt: {wrong}"


@pytest.mark.timeout(60)
def test_every_package_directory_is_listed() -> None:
    """A subpackage missing from `packages` is absent from a non-editable install."""
    listed = set(_setuptools()["packages"])
    for top in {p.split(".")[0] for p in listed}:
        for init in (ROOT / top).rglob("__init__.py"):
            name = ".".join(init.parent.relative_to(ROOT).parts)
            assert name in listed, f"{name} has an __init__.py but is not in pyproject's packages"


@pytest.mark.timeout(60)
def test_the_kernel_sources_and_headers_are_package_data() -> None:
    """cpu_kernel.py compiles csrc/*.cpp, which include csrc/*.h: both must ship."""
    data = _setuptools()["package-data"]["raylora_kernels"]
    csrc = ROOT / "raylora_kernels" / "csrc"
    suffixes = {p.suffix for p in csrc.iterdir()}
    assert suffixes == {".cpp", ".h"}
    assert {f"csrc/*{s}" for s in suffixes} <= set(data)


@pytest.mark.timeout(120)
def test_transformers_and_peft_import_next_to_the_project() -> None:
    """In a fresh interpreter, with the project's packages imported first and the repository
    on the path (as pytest and `serve run` have it): transformers' model code and peft load."""
    code = (
        "import raylora_kernels, engine\n"
        "from transformers import LlamaForCausalLM\n"
        "import peft\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
