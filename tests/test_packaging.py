"""Packaging: the YAML recipes ship inside the wheel, bare recipe names resolve, `mfqat bench` runs
from the package alone (no scripts/ folder)."""
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


def test_bench_runs_from_the_package_alone(tmp_path):
    """`mfqat bench` in an installed package: only mfqat/ on the path, no scripts/ folder, no checkout."""
    shutil.copytree(ROOT / "mfqat", tmp_path / "mfqat", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    env.pop("MFQAT_BACKEND", None)
    where = subprocess.run([sys.executable, "-c", "import mfqat; print(mfqat.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env=env, timeout=300)
    assert Path(where.stdout.strip()).parent == tmp_path / "mfqat", where.stdout + where.stderr
    assert not (tmp_path / "scripts").exists()
    run = subprocess.run([sys.executable, "-m", "mfqat", "bench", "--size", "64", "--repeats", "1", "--backends",
                          "reference", "--formats", "mxint4", "--through", "mxint8:mxint4"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("device=cpu dtype=float32 shape=(64, 64) ") and "backends=['reference']" in lines[0]
    assert lines[1].split() == ["format", "backend", "ms", "x", "clone", "%", "clone", "torchao", "ms", "torchao/ours"]
    assert lines[2].split()[:2] == ["mxint4", "reference"] and lines[2].split()[-2:] == ["nan", "nan"]
    assert lines[3].split()[:2] == ["anchor:format", "backend"] and lines[4].split()[:2] == ["mxint8:mxint4", "reference"]
    assert len(lines) == 5, run.stdout


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
    assert "mfqat/quant/kernels/bench.py" in names  # what `mfqat bench` runs


def test_version_names_the_active_backends(monkeypatch, capsys):
    """Issue 33 item 12: `mfqat --version` says whether the C++ kernels were built, Triton, MLX."""
    run = subprocess.run([sys.executable, "-m", "mfqat.cli", "--version"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("mfqat ") and len(lines) == 5, run.stdout
    assert lines[1].strip().startswith("C++ CPU kernels: ") and lines[2].strip().startswith("CUDA op: ")
    assert lines[3].strip().startswith("Triton") and "MLX" in lines[4]
    from mfqat.cli import backends
    from mfqat.quant.kernels import cpp
    assert ("C++ CPU kernels: built" in run.stdout) == cpp.AVAILABLE  # what --version says is what loads
    assert ("CUDA op: built" in run.stdout) == cpp.CUDA_AVAILABLE
    if "Triton: not installed" not in run.stdout:
        assert "TRITON_INTERPRET=1: interpreting" in run.stdout
    real = backends._spec_origin
    monkeypatch.setattr(backends, "_spec_origin", lambda name: None if name == "mfqat._C" else real(name))
    assert "C++ CPU kernels: NOT built" in backends.version_text("0")
    monkeypatch.setattr(backends, "_spec_origin", lambda name: None)
    text = backends.version_text("0")
    assert "Triton: not installed" in text and "MLX: not installed" in text


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout")
def test_wheel_from_a_clean_checkout_ships_the_cpp_kernels(tmp_path):
    """Issue 33 item 12: `pip wheel --no-build-isolation .` of the tracked files (what a fresh clone has)
    compiles csrc/ into the wheel (a few minutes on 2 cores); pyproject.toml declares the build requirements."""
    torch_version = pytest.importorskip("torch").__version__
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    src = tmp_path / "src"
    for name in filter(None, (f.decode() for f in files)):
        if name.startswith("tests/") or not (ROOT / name).is_file():
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    assert (src / "pyproject.toml").is_file() and not list(src.glob("mfqat/_C*"))
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "MAX_JOBS": "2"}
    env.pop("MFQAT_NO_EXT", None)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "-w", str(tmp_path / "dist"), "."], env=env, cwd=src, capture_output=True, text=True,
                         timeout=1500)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "WARNING: mfqat C++ extension" not in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
    (whl,) = (tmp_path / "dist").glob("mfqat-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert [n for n in names if n.startswith("mfqat/_C") and n.endswith(".so")], (torch_version, names[:20])
    requires = (src / "pyproject.toml").read_text()
    assert '"torch==' + torch_version.split("+")[0] + '"' in requires  # built against the torch it runs with
