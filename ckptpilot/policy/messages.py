"""The one place where pydantic's validation errors become a
:class:`~ckptpilot.errors.PolicyError` whose ``key`` is the dotted path in the YAML
(``scheduler.min_interval``, ``tiers.peer.endpoints[1]``, ``async.max_pending``).

The root model is passed in, so this module knows the schema only through pydantic's field
information and stays below the models it reports on.
"""

from __future__ import annotations

import difflib
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from ckptpilot.errors import PolicyError
from ckptpilot.policy.values import KeyedError, brief

_TYPE_MESSAGES = {
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "dict_type": "expected a mapping",
    "tuple_type": "expected a list",
    "list_type": "expected a list",
}


def policy_error(exc: ValidationError, root: type[BaseModel], source: str | None = None,
                 ) -> PolicyError:
    """``exc``, raised validating the model ``root``, as a :class:`PolicyError` on a YAML path."""
    errors = exc.errors(include_url=False)
    error = errors[0]
    parts, parent = _yaml_path(error["loc"], root)
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, KeyedError):
        if cause.key:
            parts.append(cause.key)
        message = cause.message
    elif isinstance(cause, ValueError):
        message = str(cause)
    elif error["type"] == "extra_forbidden":
        message = _unknown_key_message(parts[-1] if parts else "", parent)
    else:
        summary = _TYPE_MESSAGES.get(error["type"], error["msg"])
        message = f"{summary} (got {brief(error['input'])})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more problem(s) after this one"
    if source is not None:
        message += f" [in {source}]"
    return PolicyError(".".join(parts), message)


def _yaml_path(loc: tuple[int | str, ...], root: type[BaseModel],
               ) -> tuple[list[str], type[BaseModel] | None]:
    """Map a pydantic ``loc`` to YAML path parts and the model holding the last key.

    Field names become their YAML aliases (``async_`` → ``async``), list indices become
    ``[i]`` suffixes, and the union/validator tags pydantic adds after a leaf are dropped.
    """
    parts: list[str] = []
    model: type[BaseModel] | None = root
    parent: type[BaseModel] | None = None
    named = False  # the next item names an entry of a mapping of sections
    for item in loc:
        if model is None:
            if isinstance(item, int) and parts:
                parts[-1] += f"[{item}]"
            continue
        if named:  # ``scheduler.extra_signals.<name>``: the name is the user's key
            parts.append(str(item))
            named = False
            continue
        parent = model
        name, field = _field(model, str(item))
        parts.append(name)
        model = _model_of(field.annotation) if field is not None else None
        named = field is not None and model is not None and get_origin(field.annotation) is dict
    return parts, parent


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The section model an annotation holds, directly or as ``Model | None``."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _field(model: type[BaseModel], key: str) -> tuple[str, FieldInfo | None]:
    for name, field in model.model_fields.items():
        if key in (name, field.alias):
            return field.alias or name, field
    return key, None


def _unknown_key_message(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return "unknown key"
    allowed = [field.alias or name for name, field in model.model_fields.items()]
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}allowed keys: {', '.join(allowed)}"
