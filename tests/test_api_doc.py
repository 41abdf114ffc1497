"""docs/api.md names every public name of mfqat, and nothing else; each name resolves."""
import re
from pathlib import Path

import mfqat

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def documented() -> list:
    return re.findall(r"^\| `mfqat\.(\w+)` \|", DOC.read_text(), re.M)


def test_every_public_name_is_in_the_api_doc_once_and_nothing_else_is():
    names = documented()
    assert sorted(names) == sorted(set(names)), "a name is listed twice in docs/api.md"
    assert sorted(names) == sorted(mfqat.__all__)


def test_every_public_name_resolves_and_the_lazy_table_matches_all():
    assert sorted(mfqat._WHERE) == sorted(set(mfqat.__all__) - {"__version__"})
    for name in mfqat.__all__:
        assert getattr(mfqat, name) is not None, name
    assert mfqat.to_mlx is __import__("mfqat.export", fromlist=["to_mlx"]).to_mlx
