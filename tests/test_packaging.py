"""Packaging: the YAML recipes ship inside the wheel, bare recipe names resolve, `mfqat bench`
explains itself when the scripts are not installed."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mfqat.qat.config import CONFIGS_DIR, QATConfig, resolve_config, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def test_bare_recipe_names_resolve():
    assert CONFIGS_DIR == ROOT / "mfqat" / "configs"
    assert {"mxint_joint", "mxint_468_cyclic", "mxint_2468"} <= set(shipped_configs())
    assert resolve_config("mxint_joint") == CONFIGS_DIR / "mxint_joint.yaml"
    assert resolve_config("mxint_joint.yaml") == CONFIGS_DIR / "mxint_joint.yaml"
    assert QATConfig.from_yaml("mxint_joint").schedule == "joint"
    assert QATConfig.from_yaml(ROOT / "configs" / "mxint_joint.yaml").schedule == "joint"  # root configs/ still works


def test_unknown_recipe_lists_the_shipped_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="mxint_468_cyclic") as e:
        QATConfig.read_yaml("no_such_recipe")
    assert "no_such_recipe" in str(e.value)
    with pytest.raises(FileNotFoundError, match="shipped"):
        QATConfig.read_yaml(tmp_path / "missing.yaml")


def test_bench_without_scripts_says_why(monkeypatch):
    from mfqat.cli import app as cli

    real = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: False if p.name == "bench_quant.py" else real(p))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert "source repository" in str(e.value.code) and "bench_quant.py" in str(e.value.code)


def _source_copy(dst: Path) -> Path:
    """The repository's sources without build outputs (the build never touches this checkout)."""
    ignore = shutil.ignore_patterns(".git", ".venv", "build", "dist", "out", "runs", "*.egg-info", "*.so",
                                    "__pycache__", ".pytest_cache", ".hypothesis", "tests")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)
    return dst


def test_wheel_ships_the_yaml_recipes(tmp_path):
    src = _source_copy(tmp_path / "src")
    env = {**os.environ, "MFQAT_NO_EXT": "1", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, env=env, cwd=tmp_path, timeout=300)
    (whl,) = (tmp_path / "dist").glob("mfqat-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    want = {f"mfqat/configs/{n}.yaml" for n in shipped_configs()}
    want |= {f"mfqat/configs/accelerate/{p.name}" for p in (CONFIGS_DIR / "accelerate").glob("*.yaml")}
    assert len(want) >= 11 and want <= names, sorted(want - names)
    assert "mfqat/cli/app.py" in names and not any(n.endswith(".so") for n in names)
