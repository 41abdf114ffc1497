"""The mutation check's data and matcher (scripts/dev/mutations.yaml, scripts/dev/mutation_specs.py):
every planted bug still lands exactly once in the code it names and names tests that exist, and the
matcher finds its code after the function moved or was reformatted. No pytest run per mutation."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mutation_specs", ROOT / "scripts" / "dev" / "mutation_specs.py")
ms = importlib.util.module_from_spec(_spec)
sys.modules["mutation_specs"] = ms  # dataclasses look the module up while the class is made
_spec.loader.exec_module(ms)


def test_every_spec_applies_exactly_once_in_its_function_and_names_tests_that_exist():
    mutations = ms.load()
    assert len(mutations) > 200
    assert ms.problems(ROOT, mutations) == {}


# --- the matcher on a small made-up source -----------------------------------------------------------------

BEFORE = '''\
import os


def scale(x, limit):
    """Clamp then scale."""
    if x > limit:
        x = limit
    total = compute(x, limit, os.sep)
    log(total)
    return total * 2


def other(x):
    return x * 2
'''

# scale moved below other, into a class (a method now), indented deeper, a call wrapped over lines
AFTER = '''\
import os


def other(x):
    return x * 2


class Box:
    def scale(self, x, limit):
        """Clamp then scale."""
        if x > limit:
            x = limit
        total = compute(
            x, limit,
            os.sep)
        log(total)
        return total * 2
'''


def mutation(function, pattern, replacement):
    return ms.Mutation("made-up", "made_up.py", function, pattern, replacement, ("tests/x.py",))


def test_a_spec_still_applies_after_its_function_moved_and_was_reindented():
    clamp = "if x > limit:\n    x = limit\n"
    unclamped = "if x > limit:\n    pass\n"
    assert ms.apply(BEFORE, mutation("scale", clamp, unclamped)) == BEFORE.replace(
        "        x = limit\n", "        pass\n")
    assert ms.apply(AFTER, mutation("Box.scale", clamp, unclamped)) == AFTER.replace(
        "            x = limit\n", "            pass\n")
    # inline, across the wrapped call; whole lines deleted; a multi-line replacement re-based
    wrong_arg = ms.apply(AFTER, mutation("Box.scale", "compute(x, limit, os.sep)", "compute(limit, x, os.sep)"))
    assert "total = compute(limit, x, os.sep)\n        log(total)" in wrong_arg
    bumped = ms.apply(AFTER, mutation("Box.scale", "x = limit", "x = limit\nx += 1"))
    assert bumped == AFTER.replace("            x = limit\n", "            x = limit\n            x += 1\n")
    unlogged = ms.apply(AFTER, mutation("Box.scale", "log(total)\n", ""))
    assert unlogged == AFTER.replace("        log(total)\n", "")
    doubled = ms.apply(AFTER, mutation("Box.scale", "return total * 2\n", "if x:\n    total += 1\nreturn total * 2\n"))
    assert doubled == AFTER.replace("        return total * 2\n",
                                    "        if x:\n            total += 1\n        return total * 2\n")


def test_the_pattern_is_looked_for_in_its_function_only():
    twice = "return x * 2"  # in other; in scale only as part of "return total * 2"
    assert ms.apply(BEFORE, mutation("other", twice, "return x")).endswith("def other(x):\n    return x\n")
    with pytest.raises(ms.SpecError, match="0 times in function scale of made_up.py"):
        ms.apply(BEFORE, mutation("scale", twice, "return x"))
    with pytest.raises(ms.SpecError, match="no function or class Box.scale in made_up.py"):
        ms.apply(BEFORE, mutation("Box.scale", "return total * 2", "return total"))


def test_a_pattern_twice_in_its_function_is_refused_naming_the_function():
    with pytest.raises(ms.SpecError, match="2 times in function Box.scale of made_up.py"):
        ms.apply(AFTER, mutation("Box.scale", "x, limit", "limit, x"))  # the signature and the call
    assert ms.apply(AFTER, mutation("<module>", "def other(x):", "def other(y):")).count("other(y)") == 1


def test_problems_name_a_missing_function_a_missing_test_and_a_twice_matching_pattern(tmp_path):
    (tmp_path / "made_up.py").write_text(AFTER)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_made_up.py").write_text("class TestBox:\n    def test_scale(self):\n        pass\n")
    ok = ms.Mutation("ok", "made_up.py", "other", "x * 2", "x", ("tests/test_made_up.py::TestBox::test_scale[1]",))
    gone = ms.Mutation("gone", "made_up.py", "scale", "x * 2", "x", ("tests/test_made_up.py",))
    twice = ms.Mutation("twice", "made_up.py", "Box.scale", "limit", "x", ("tests/test_made_up.py",))
    untested = ms.Mutation("untested", "made_up.py", "other", "x * 2", "x", ("tests/test_made_up.py::test_nope",
                                                                            "tests/test_missing.py"))
    found = ms.problems(tmp_path, [ok, gone, twice, untested])
    assert set(found) == {"gone", "twice", "untested"}
    assert "no function or class scale" in found["gone"]
    assert "occurs 4 times in function Box.scale" in found["twice"]
    assert "no test_nope in tests/test_made_up.py" in found["untested"]
    assert "no test file tests/test_missing.py" in found["untested"]


def test_the_data_file_is_refused_with_a_missing_field_or_a_name_used_twice(tmp_path):
    entry = ("- name: a\n  file: f.py\n  function: f\n  pattern: 'x'\n  replacement: 'y'\n"
             "  tests: [tests/test_f.py]\n")
    (tmp_path / "m.yaml").write_text(entry + entry)
    with pytest.raises(ms.SpecError, match="names used twice: a"):
        ms.load(tmp_path / "m.yaml")
    (tmp_path / "m.yaml").write_text(entry.replace("  function: f\n", ""))
    with pytest.raises(ms.SpecError, match="entry 1 \\(a\\): needs exactly the fields"):
        ms.load(tmp_path / "m.yaml")
