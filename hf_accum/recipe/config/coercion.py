"""Keys and types read from the classes themselves, and values coerced to them.

A section's keys are the ``__init__`` parameters of its class (a recipe dataclass or an HF class);
their types come from the annotations. Command-line values arrive as YAML scalars and are
converted here (``"1e-4"`` -> float, ``"true"`` -> bool); anything that does not fit raises
``TypeError``/``ValueError``, which :func:`hf_accum.recipe.config.schema.coerce` turns into a
one-line error naming the key.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from typing import Any


def field_types(cls) -> dict[str, Any]:
    """``{name: annotation}`` of the keys ``cls(**kwargs)`` accepts.

    The keys are the ``__init__`` parameters (BitsAndBytesConfig is a dataclass with a
    hand-written ``__init__``, so its dataclass fields are not its keys); the types come from the
    class annotations where they exist, else from the default value (``Any`` when it is None).
    """
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: check keys, not types
        hints = {}
    types_: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        default = param.default
        fallback = type(default) if isinstance(default, (bool, int, float, str)) else Any
        types_[name] = hints.get(name, fallback)
    return types_




def coerce_value(value: Any, ann: Any) -> Any:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if ann is Any or ann is inspect.Parameter.empty:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        # Exact type matches first, so "16" stays a str for Union[str, int] but 16 stays an int.
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: not _matches_exactly(value, a)):
            try:
                return coerce_value(value, arg)
            except (TypeError, ValueError):
                continue
        raise TypeError(value)
    if origin is typing.Literal:
        if value in args:
            return value
        raise ValueError(value)
    if ann is type(None):
        if value is None:
            return None
        raise TypeError(value)
    if ann is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise TypeError(value)
    if ann is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return int(value)
        raise TypeError(value)
    if ann is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return float(value)
        raise TypeError(value)
    if ann is str:
        if isinstance(value, str):
            return value
        raise TypeError(value)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        if value is False and "no" in {member.value for member in ann}:
            value = "no"  # YAML 1.1 reads an unquoted no (save_strategy: no) as false
        return ann(value).value if not isinstance(value, ann) else value.value
    if origin in (list, tuple, set, typing.Sequence) or ann in (list, tuple, set):
        if not isinstance(value, (list, tuple)):
            raise TypeError(value)
        item = args[0] if args else Any
        return [coerce_value(v, item) for v in value]
    if origin is dict or ann is dict:
        if not isinstance(value, dict):
            raise TypeError(value)
        return value
    return value  # other classes (AcceleratorConfig, LoftQConfig...): their constructors check


def _matches_exactly(value: Any, ann: Any) -> bool:
    base = typing.get_origin(ann) or ann
    return isinstance(base, type) and isinstance(value, base) and not (base is int and isinstance(value, bool))


def type_name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


