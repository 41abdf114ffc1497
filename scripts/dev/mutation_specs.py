"""The planted bugs of the mutation check, kept as data (mutations.yaml beside this file), and the matcher
that plants one in a source text.

A spec names a file, the function that holds the code (its qualified name: ``f``, ``Class.method``,
``outer.inner``; ``<module>`` for the whole file, the only choice outside Python), a pattern and its
replacement. The pattern must occur exactly once in the source span of that function, which ``ast``
finds wherever the function now sits in the file. Matching ignores layout:

- a run of whitespace in the pattern matches any run of whitespace, newlines included; no whitespace
  is needed after an opening or before a closing bracket (a call wrapped over lines still matches);
- a pattern that ends with a newline names whole lines: its first line starts at a line's first
  non-blank character, its last line ends the line; those lines are replaced by the replacement's lines
  (none when the replacement is empty);
- otherwise the matched text is replaced in place; whitespace before or after the pattern is part of
  the match (the blanks beside it on the same line);
- indentation inside the pattern is not compared, and the replacement's indentation is relative: the
  replacement's lines after the first (and every line of a whole-line replacement) are indented by the
  indentation of the source line where the match begins, plus their own.
"""
from __future__ import annotations

import ast
import functools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

MODULE = "<module>"
DATA = Path(__file__).resolve().with_name("mutations.yaml")
FIELDS = ("name", "file", "function", "pattern", "replacement", "tests")


class SpecError(ValueError):
    """A spec that no longer applies to the source (one line: what is wrong and where)."""


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``pattern`` -> ``replacement`` inside ``function`` of ``file``; ``tests`` must fail."""

    name: str
    file: str
    function: str
    pattern: str
    replacement: str
    tests: Tuple[str, ...]
    why: str = ""


def load(path: Path = DATA) -> List[Mutation]:
    """The mutations of a data file, each checked to have the fields it needs and a name of its own."""
    import yaml

    entries = yaml.safe_load(Path(path).read_text()) or []
    out: List[Mutation] = []
    for i, e in enumerate(entries):
        label = e.get("name", "unnamed") if isinstance(e, dict) else repr(e)
        where = f"{path}: entry {i + 1} ({label})"
        if not isinstance(e, dict) or set(FIELDS) - set(e) or set(e) - set(FIELDS) - {"why"}:
            raise SpecError(f"{where}: needs exactly the fields {', '.join(FIELDS)} (and optionally why)")
        if not isinstance(e["tests"], list) or not e["tests"] or not all(isinstance(t, str) for t in e["tests"]):
            raise SpecError(f"{where}: tests must be a non-empty list of test paths or node ids")
        if not all(isinstance(e[k], str) for k in FIELDS[:5]) or not e["pattern"].strip():
            raise SpecError(f"{where}: name, file, function, pattern and replacement must be strings, "
                            "the pattern not blank")
        out.append(Mutation(e["name"], e["file"], e["function"], e["pattern"], e["replacement"],
                            tuple(e["tests"]), e.get("why", "")))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError(f"{path}: names used twice: {', '.join(dup)}")
    return out


# --- where a function is ------------------------------------------------------------------------------------

def line_starts(text: str) -> List[int]:
    """Offsets of the first character of every line (plus one past the end)."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    return starts if starts[-1] == len(text) else starts + [len(text)]


@functools.lru_cache(maxsize=64)
def tree_of(text: str) -> ast.Module:
    """The parsed source (cached: many specs and tests share a file)."""
    return ast.parse(text)


@functools.lru_cache(maxsize=64)
def definitions(text: str) -> Tuple[Tuple[str, int, int], ...]:
    """(qualified name, start, end) of every function and class of a Python source: whole lines from the
    first decorator through the last line of the body."""
    starts = line_starts(text)
    out: List[Tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out.append((name, starts[first - 1], starts[min(child.end_lineno, len(starts) - 1)]))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(tree_of(text), "")
    return tuple(out)


def spans_of(text: str, file: str, function: str) -> List[Tuple[int, int]]:
    """The source spans of ``function`` in ``text`` (several when one name is defined twice, e.g. a
    property's getter and setter); the whole text for ``<module>``."""
    if function == MODULE:
        return [(0, len(text))]
    if not file.endswith(".py"):
        raise SpecError(f"{file} is not Python: its function must be {MODULE}")
    try:
        found = [(a, b) for name, a, b in definitions(text) if name == function]
    except SyntaxError as e:
        raise SpecError(f"{file} does not parse ({e.msg}, line {e.lineno})") from None
    if not found:
        raise SpecError(f"no function or class {function} in {file} (renamed? update the spec)")
    return found


def enclosing(text: str, start: int, end: int) -> str:
    """The qualified name of the innermost function or class whose span holds ``text[start:end]``."""
    best = (MODULE, 0, len(text))
    for name, a, b in definitions(text):
        if a <= start and end <= b and b - a < best[2] - best[1]:
            best = (name, a, b)
    return best[0]


# --- the matcher --------------------------------------------------------------------------------------------

OPEN, CLOSE = "([{", ")]}"


def core_regex(core: str) -> str:
    """The regex of a pattern stripped of its outer whitespace: its whitespace runs match any whitespace
    run; just inside a bracket, whitespace may appear where the pattern has none."""
    out = []
    for i, part in enumerate(re.split(r"(\s+)", core)):
        if i % 2:
            out.append(r"\s+")
            continue
        for j, ch in enumerate(part):
            if j and (part[j - 1] in OPEN or ch in CLOSE):
                out.append(r"\s*")
            out.append(re.escape(ch))
    return "".join(out)


def whole_lines(pattern: str) -> bool:
    """A pattern ending with a newline names whole lines."""
    return pattern.rstrip(" \t").endswith("\n")


def regex_of(pattern: str) -> "re.Pattern[str]":
    """The compiled matcher of a pattern (see the module docstring)."""
    lead = pattern[:len(pattern) - len(pattern.lstrip())]
    trail = pattern[len(pattern.rstrip()):]
    body = core_regex(pattern.strip())
    if whole_lines(pattern):
        return re.compile(r"^[ \t]*" + body + r"(?:[ \t]*\n)" * trail.count("\n"), re.MULTILINE)
    return re.compile(("[ \t]+" if lead else "") + body + ("[ \t]+" if trail else ""))


def indent_of(text: str, pos: int) -> str:
    """The indentation of the line holding ``pos``."""
    start = text.rfind("\n", 0, pos) + 1
    return re.match(r"[ \t]*", text[start:]).group()


def rebased(replacement: str, indent: str, lines: bool) -> str:
    """The replacement as it goes into the source: later lines (every line for whole lines) get the
    indentation of the line where the match begins."""
    if lines:
        body = replacement[:-1] if replacement.endswith("\n") else replacement
        return "".join((indent + l if l.strip() else l) + "\n" for l in body.split("\n")) if replacement else ""
    first, *rest = replacement.split("\n")
    return "\n".join([first] + [indent + l if l.strip() else l for l in rest])


def find(text: str, m: Mutation) -> List["re.Match[str]"]:
    """Every match of ``m``'s pattern inside its function's spans."""
    rx = regex_of(m.pattern)
    return [hit for a, b in spans_of(text, m.file, m.function) for hit in rx.finditer(text, a, b)]


def apply(text: str, m: Mutation) -> str:
    """``text`` with ``m`` planted; SpecError unless the pattern occurs exactly once in its function."""
    hits = find(text, m)
    if len(hits) != 1:
        where = "the module" if m.function == MODULE else f"function {m.function}"
        raise SpecError(f"the pattern occurs {len(hits)} times in {where} of {m.file} (needs exactly once; "
                        "update the spec)")
    start, end = hits[0].span()
    lines, replacement = whole_lines(m.pattern), m.replacement
    if lines:
        replacement = textwrap.dedent(replacement)
    elif text[start] in " \t" and (start == 0 or text[start - 1] == "\n"):  # the lead is the indentation
        start += len(indent_of(text, start))
        replacement = replacement.lstrip(" \t")
    return text[:start] + rebased(replacement, indent_of(text, start), lines) + text[end:]


def plant(root: Path, m: Mutation) -> Tuple[Path, str, str]:
    """(path, original text, mutated text) of ``m`` under ``root``; SpecError naming the spec if it no
    longer applies."""
    path = root / m.file
    if not path.is_file():
        raise SpecError(f"{m.name}: no file {m.file}")
    original = path.read_text()
    try:
        return path, original, apply(original, m)
    except SpecError as e:
        raise SpecError(f"{m.name}: {e}") from None


# --- the tests a spec names ---------------------------------------------------------------------------------

def test_defined(root: Path, node: str) -> Optional[str]:
    """Why ``node`` (``path`` or ``path::name[params]`` or ``path::Class::name``) names no test, or None."""
    path, *names = node.split("::")
    f = root / path
    if not f.is_file():
        return f"no test file {path}"
    if not names:
        return None
    names = [n.split("[", 1)[0] for n in names]
    scope: Sequence[ast.AST] = tree_of(f.read_text()).body
    for n in names:
        hit = [d for d in scope if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and d.name == n]
        if not hit:
            return f"no {'::'.join(names)} in {path}"
        scope = hit[0].body
    return None


def problems(root: Path, mutations: Sequence[Mutation]) -> Dict[str, str]:
    """Every spec that does not apply in the tree at ``root`` or names a missing test: name -> why."""
    out: Dict[str, str] = {}
    for m in mutations:
        try:
            plant(root, m)
        except SpecError as e:
            out[m.name] = str(e)
            continue
        missing = [w for w in (test_defined(root, t) for t in m.tests) if w]
        if missing:
            out[m.name] = f"{m.name}: " + "; ".join(missing)
    return out
