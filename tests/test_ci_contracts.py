"""The import contract (.importlinter) and the type check ([tool.mypy]) that .ci/run runs: the tree keeps them,
and each catches a violation planted in a copy of the tree (so neither passes because it looks at nothing)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _copy(tmp_path: Path, *packages: str) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    for name in (".importlinter", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    for package in packages:
        src = ROOT / package
        if src.is_dir():
            shutil.copytree(src, root / package, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (root / package).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / package)
    return root


def _run(tool: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if not (BIN / tool).exists():
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    # the copy first on the path: the gateway package checked is the copy, not the installed tree
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(BIN / tool), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _plant(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_import_contract_holds_and_breaks_on_a_clock_in_translate(tmp_path: Path) -> None:
    kept = _run("lint-imports", ROOT)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "0 broken" in kept.stdout

    tree = _copy(tmp_path, "gateway")
    _plant(tree / "gateway" / "translate" / "usage.py", "\n\nimport time  # noqa: E402\n")
    _plant(tree / "gateway" / "store" / "base.py", "\n\nfrom gateway.engine import record  # noqa: E402,F401\n")
    broken = _run("lint-imports", tree, "--no-cache")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "gateway.translate.usage -> time" in broken.stdout  # the pure core
    assert "gateway.store.base -> gateway.engine.record" in broken.stdout  # the layers


def test_the_type_check_is_strict_on_the_core_only(tmp_path: Path) -> None:
    tree = _copy(tmp_path, "gateway/__init__.py", "gateway/errors.py", "gateway/protocol", "gateway/translate")
    untyped = "\n\ndef _planted(x):\n    return x\n"
    _plant(tree / "gateway" / "translate" / "usage.py", untyped)
    _plant(tree / "gateway" / "errors.py", untyped)  # outside the strict packages: allowed
    out = _run("mypy", tree, "--no-incremental", "--cache-dir", os.devnull)
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("gateway/translate/usage.py:"), out.stdout
    assert "[no-untyped-def]" in errors[0]
