"""An unknown setting, said so that a user can fix it: which section it is in, and the setting it most likely meant.

pydantic reports a key that a model does not have as "Extra inputs are not permitted". :func:`unknown_setting`
walks the model down to the key's section and says instead
``unknown setting 'listn' in section 'front'; did you mean 'listen'?`` (difflib's nearest name), or, with no
name near enough, which settings the section has. Both configuration loaders use it: ``raven.config.loading``
(the services' files, environment and flags) and ``raven.layer3.config`` (a ``layer3:`` section on its own).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

EXTRA = "extra_forbidden"  # pydantic's error type for a key the model does not have
MAX_KEY = 64  # characters of an unknown key repeated back (a key is the user's own text, of any length)
MAX_LISTED = 20  # settings listed when no name is near enough


def _expand(annotation: Any) -> Iterator[Any]:
    """The types an annotation may hold: through ``X | None``, ``Union`` and ``Annotated``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        yield from _expand(typing.get_args(annotation)[0])
    elif origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(annotation):
            yield from _expand(arg)
    else:
        yield annotation


def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _step(annotation: Any, part: str | int) -> list[Any]:
    """What ``annotation`` holds at ``part`` of an error's location (a field, a list index, a mapping key)."""
    out: list[Any] = []
    for t in _expand(annotation):
        origin = typing.get_origin(t)
        args = typing.get_args(t)
        if _is_model(t) and isinstance(part, str) and part in t.model_fields:
            out.append(t.model_fields[part].annotation)
        elif _is_model(t) and part == t.__name__:  # pydantic names the member of a union it tried
            out.append(t)
        elif origin in (list, tuple, set, frozenset) or (isinstance(origin, type) and issubclass(origin, Sequence)
                                                         and not issubclass(origin, str)):
            if isinstance(part, int) and args:
                out += [a for a in args if a is not Ellipsis]
        elif (origin is dict or (isinstance(origin, type) and issubclass(origin, Mapping))) and len(args) == 2:
            out.append(args[1])
    return out


def section_settings(model: type[BaseModel], section: Sequence[str | int]) -> list[str]:
    """The setting names of the section at ``section`` (a pydantic location without the unknown key)."""
    kinds: list[Any] = [model]
    for part in section:
        kinds = [k for annotation in kinds for k in _step(annotation, part)]
    names: list[str] = []
    for annotation in kinds:
        for t in _expand(annotation):
            if _is_model(t):
                names += [n for n in t.model_fields if n not in names]
    return names


def _short(key: str) -> str:
    return key if len(key) <= MAX_KEY else key[:MAX_KEY] + "..."


def unknown_setting(model: type[BaseModel], loc: Sequence[str | int], where: Sequence[str] = ()) -> str:
    """What to say about the unknown key at ``loc`` (pydantic's location, the key last) of ``model``.

    ``where`` is the path of ``model`` itself within what the user wrote (``("layer3",)`` for a section parsed
    on its own), so that the section is named as the user knows it."""
    key = str(loc[-1])
    section = ".".join(str(p) for p in (*where, *loc[:-1]))
    settings = section_settings(model, loc[:-1])
    text = f"unknown setting {_short(key)!r} " + (f"in section {section!r}" if section else "at the top level")
    nearest = difflib.get_close_matches(key.lower(), settings, n=1, cutoff=0.6)
    if nearest:
        return f"{text}; did you mean {nearest[0]!r}?"
    if settings:
        listed = ", ".join(settings[:MAX_LISTED]) + (", ..." if len(settings) > MAX_LISTED else "")
        return f"{text}; the settings there: {listed}"
    return text
