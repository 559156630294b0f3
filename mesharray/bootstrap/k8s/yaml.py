"""A YAML emitter for manifests: block style, strings quoted where YAML would misread them.

No YAML library is needed to print a manifest (``python -m mesharray k8s
manifest`` runs without one): the objects are plain dicts, lists, strings,
numbers and booleans, and a JSON string is a YAML double-quoted scalar, so
every string that YAML 1.1 could read as something else (``"8"``, ``"-m"``,
``"on"``) is written as JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Mapping

__all__ = ["dump_yaml"]

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")
_KEYWORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} in a manifest")
        return repr(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _KEYWORDS:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def _emit(value: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, Mapping):
        for k, v in value.items():
            key = _scalar(str(k))
            if isinstance(v, (Mapping, list, tuple)) and v:
                out.append(f"{pad}{key}:")
                _emit(v, indent + (0 if isinstance(v, (list, tuple)) else 2), out)
            else:
                out.append(f"{pad}{key}: {_inline(v)}")
    else:
        for item in value:
            if isinstance(item, (Mapping, list, tuple)) and item:
                sub: list[str] = []
                _emit(item, indent + 2, sub)
                out.append(f"{pad}- {sub[0][indent + 2:]}")
                out.extend(sub[1:])
            else:
                out.append(f"{pad}- {_inline(item)}")


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return _scalar(value)


def dump_yaml(objs: Iterable[Mapping[str, Any]]) -> str:
    """The objects as a multi-document YAML stream (block style; strings quoted where YAML would misread them).

    Examples
    --------
    >>> print(dump_yaml([{"a": "1", "b": [{"c": True, "d": []}], "e": "x y"}]), end="")
    ---
    a: "1"
    b:
    - c: true
      d: []
    e: "x y"
    """
    out: list[str] = []
    for obj in objs:
        out.append("---")
        _emit(obj, 0, out)
    return "\n".join(out) + "\n"

