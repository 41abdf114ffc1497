"""The package's layering (docs/architecture.md): no import cycle, no import from a lower layer to a
higher one or to a peer, every module in a layer, and the generated picture up to date.

The checker itself is tested on small packages written here, so a checker that finds nothing
cannot pass for a clean tree."""
import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gen_layers", ROOT / "scripts" / "dev" / "gen_layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def test_no_cycle_in_the_package():
    assert layers.find_cycle(layers.import_graph(ROOT / "mfqat")) is None


def test_imports_only_go_down():
    assert layers.violations(layers.import_graph(ROOT / "mfqat")) == []


def test_top_level_holds_only_the_agreed_modules():
    loose = sorted(p.name for p in (ROOT / "mfqat").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "_build.py", "_moved.py", "formats.py", "memory.py", "progress.py"]


def test_the_roots_lazy_names_are_its_imports_and_nothing_imports_the_root():
    graph = layers.import_graph(ROOT / "mfqat")
    assert {"mfqat.export.mlx_export", "mfqat.mxqlora.model", "mfqat.integrations.hf_quantizer"} <= graph["mfqat"]
    assert [m for m, deps in graph.items() if "mfqat" in deps] == []


def test_every_module_is_in_the_architecture_table():
    assert layers.undocumented(ROOT / "mfqat", layers.DOC.read_text()) == []


def test_architecture_picture_is_current():
    assert layers.main(["--check"]) == 0


def _package(tmp_path: Path, files: dict) -> Path:
    pkg = tmp_path / "mfqat"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


def test_checker_finds_a_planted_cycle(tmp_path):
    pkg = _package(tmp_path, {"anchor/__init__.py": "", "anchor/a.py": "from mfqat.anchor.b import x\n",
                              "anchor/b.py": "def f():\n    from . import a\nx = 1\n"})
    cycle = layers.find_cycle(layers.import_graph(pkg))
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"mfqat.anchor.a", "mfqat.anchor.b"}


@pytest.mark.parametrize("line", ["from mfqat.export.x import y", "import mfqat.export.x",
                                  "from ..export import x", "from mfqat.cli import main"])
def test_checker_finds_an_upward_import(tmp_path, line):
    pkg = _package(tmp_path, {"quant/__init__.py": "", "quant/api.py": f"def f():\n    {line}\n",
                              "export/__init__.py": "", "export/x.py": "y = 1\n",
                              "cli/__init__.py": "main = 1\n"})
    found = layers.violations(layers.import_graph(pkg))
    assert len(found) == 1 and found[0].startswith("mfqat.quant.api imports mfqat.")


def test_checker_refuses_peer_imports_and_unknown_modules(tmp_path):
    pkg = _package(tmp_path, {"eval/__init__.py": "", "eval/a.py": "from mfqat.export import b\n",
                              "export/__init__.py": "", "export/b.py": "", "stray.py": ""})
    found = layers.violations(layers.import_graph(pkg))
    assert any("is a peer of mfqat.eval" in v for v in found)
    assert any(v.startswith("mfqat.stray: in no layer") for v in found)


def test_checker_reads_the_roots_lazy_table_and_import_module_strings(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "_PUBLIC = {'.export.x': ['y'], '.quant': ['q']}\n",
                              "quant/__init__.py": "q = 1\n", "export/__init__.py": "", "export/x.py": "y = 1\n",
                              "quant/api.py": "from importlib import import_module\n"
                                              "def f():\n    return import_module('mfqat.export.x')\n"})
    graph = layers.import_graph(pkg)
    assert graph["mfqat"] == {"mfqat.export.x", "mfqat.quant"}
    assert layers.violations(graph) == ["mfqat.quant.api imports mfqat.export.x: mfqat.export is above mfqat.quant "
                                        "(docs/architecture.md, Layers)"]


@pytest.mark.parametrize("line,upward", [("from mfqat import __version__", True), ("import mfqat", True),
                                         ("from mfqat import _C", False),
                                         ("from mfqat._build import EXTENSION", False)])
def test_checker_sees_an_import_of_the_root_but_not_of_the_extension(tmp_path, line, upward):
    pkg = _package(tmp_path, {"quant/__init__.py": "", "quant/api.py": f"{line}\n", "_build.py": "EXTENSION = 1\n"})
    found = layers.violations(layers.import_graph(pkg))
    assert found == (["mfqat.quant.api imports mfqat: mfqat is above mfqat.quant (docs/architecture.md, Layers)"]
                     if upward else [])


TABLE = """
| folder | files | what it does |
|---|---|---|
| `mfqat/` | `__init__.py` | the root |
| `quant/` | `api.py` | one |
| | `kernels/` | the kernels: `cpp.py` |

after the table: `stray.py`
"""


def test_checker_finds_a_module_missing_from_the_architecture_table(tmp_path):
    pkg = _package(tmp_path, {"quant/__init__.py": "", "quant/api.py": "", "quant/kernels/__init__.py": "",
                              "quant/kernels/cpp.py": ""})
    assert layers.undocumented(pkg, TABLE) == []
    for planted in ("quant/new.py", "quant/kernels/new.py", "stray.py"):
        (pkg / planted).write_text("")
        assert layers.undocumented(pkg, TABLE) == [f"mfqat/{planted}: not in the table of folders and files of "
                                                  "docs/architecture.md"], planted
        (pkg / planted).unlink()
