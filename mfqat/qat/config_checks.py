"""Field checks of QATConfig: each raises a TypeError / ValueError that names the field."""
from __future__ import annotations

import re
from typing import Any, List, NoReturn, Tuple, Union

from mfqat.formats import get_format


def _fail(field_name: str, message: str) -> NoReturn:
    """Raise the ValueError of an invalid QATConfig field (the message names the field)."""
    raise ValueError(f"QATConfig.{field_name}: {message}")


def _type_error(field_name: str, value: Any, what: str) -> NoReturn:
    """Raise the TypeError of a QATConfig field holding the wrong kind of value."""
    raise TypeError(f"QATConfig.{field_name}: expected {what}, got {value!r} ({type(value).__name__})")


def _check_type(field_name: str, value: Any, types: Tuple[type, ...], what: str) -> None:
    """``value`` must be an instance of ``types`` (bool is never an int here)."""
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        _type_error(field_name, value, what)


def _check_regexes(field_name: str, value: Any, optional: bool = False) -> None:
    """A regex or a list of regexes, each of which must compile."""
    if value is None and optional:
        return
    pats = [value] if isinstance(value, str) else value
    if not isinstance(pats, (list, tuple)) or not all(isinstance(p, str) for p in pats):
        _type_error(field_name, value, "a regex or a list of regexes" + (" or None" if optional else ""))
    for p in pats:
        try:
            re.compile(p)
        except re.error as exc:
            _fail(field_name, f"invalid regular expression {p!r}: {exc}")


def _check_mx_formats(field_name: str, value: Any, block_size: int) -> None:
    """A non-empty list of MX format names that all allow ``block_size``."""
    if not isinstance(value, (list, tuple)):
        _type_error(field_name, value, "a non-empty list of format names")
    if not value:
        _fail(field_name, "needs at least one format")
    for f in value:
        _check_mx_format(field_name, f, block_size)


AFFINE_NAMES = tuple(f"affine{k}" for k in range(2, 9))
DERIVED_NAMES = AFFINE_NAMES + ("nvfp4",)  # the derived formats a QATConfig may train


def _check_qat_formats(field_name: str, value: Any, block_size: int) -> None:
    """Like _check_mx_formats, but the derived formats (affine2..8, nvfp4; mfqat.quant.derive) may join."""
    if isinstance(value, (list, tuple)) and value:
        value = [f for f in value if not (isinstance(f, str) and f.lower() in DERIVED_NAMES)]
        if not value:
            return
    _check_mx_formats(field_name, value, block_size)


def _check_mx_format(field_name: str, value: Any, block_size: int) -> None:
    """One MX format name that allows ``block_size``."""
    _check_type(field_name, value, (str,), "MX format names")
    try:
        fmt = get_format(value)
    except ValueError as exc:
        _fail(field_name, str(exc))
    if not fmt.is_mx:
        _fail(field_name, f"'{value}' is not an MX format; MF-QAT takes mxint2..mxint8 and mxfp4/6/8")
    if block_size not in fmt.block_sizes:
        _fail("block_size", f"{block_size} is not allowed for '{fmt.name}'; allowed: {list(fmt.block_sizes)}")


OBSERVERS = ("window_minmax",)


def _check_observer(kind: Any, window: Any, quantize_activations: bool) -> None:
    """activation_observer: None or a known observer, with a window >= 1, not with quantize_activations."""
    _check_type("observer_window", window, (int,), "an int")
    if window < 1:
        _fail("observer_window", f"must be >= 1, got {window}")
    if kind is None:
        return
    _check_type("activation_observer", kind, (str,), "an observer name or null")
    if kind not in OBSERVERS:
        _fail("activation_observer", f"unknown observer '{kind}'; choose one of {list(OBSERVERS)} or null")
    if quantize_activations is True:
        _fail("activation_observer", "static observers replace the dynamic MX activation fake quant; "
                                     "set quantize_activations: false, or activation_observer: null")


def _patterns(p: Union[str, List[str], None]) -> List[re.Pattern]:
    if p is None:
        return []
    return [re.compile(x) for x in ([p] if isinstance(p, str) else p)]


def _matches(name: str, pats: List[re.Pattern]) -> bool:
    return any(p.search(name) for p in pats)
