"""MkDocs hook: the policy and CLI references, generated from the code at every build.

The policy reference comes from the pydantic schema of :class:`ckptpilot.policy.Policy`, the CLI
reference from :func:`ckptpilot.cli.build_parser`, so neither can drift from what the code
accepts. Each reference page is written by hand around a marker line that the hook replaces:
``<!-- generated: policy -->`` or ``<!-- generated: cli -->``. A page without its marker, or a
marker on another page, fails the build: a reference that silently vanished is worse than none.

``tests/test_docs.py`` imports this file to check that every policy key and every subcommand
appears in what it generates.
"""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Any

from pydantic import BaseModel

from ckptpilot.cli import build_parser
from ckptpilot.policy import Policy, parse_byte_size

MARKERS = {"reference/policy.md": "<!-- generated: policy -->",
           "reference/cli.md": "<!-- generated: cli -->"}

_RST_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc):`~?([^`]+)`")
_SPEC_CITATION = re.compile(r" \(SPEC §[^)]*\)")
"""The design notes a docstring cites are not shipped with the documentation."""


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace the marker of a reference page with the generated text."""
    path = page.file.src_uri
    for where, marker in MARKERS.items():
        if path != where and marker in markdown:
            raise ValueError(f"{path}: {marker} belongs to {where} only")
    if path not in MARKERS:
        return markdown
    marker = MARKERS[path]
    if markdown.count(marker) != 1:
        raise ValueError(f"{path}: expected the line {marker} exactly once")
    generated = policy_reference() if path == "reference/policy.md" else cli_reference()
    return markdown.replace(marker, generated)


def _markdown(doc: str | None) -> str:
    """A docstring as Markdown: reST double backticks and roles become code spans."""
    if not doc:
        return ""
    text = _RST_ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", inspect.cleandoc(doc))
    text = _SPEC_CITATION.sub("", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# --- the policy ------------------------------------------------------------------------------

def policy_reference() -> str:
    """One section per policy model, in the order of the YAML, with a table of its keys."""
    schema = Policy.model_json_schema(by_alias=True)
    sections: list[str] = []
    _policy_section(Policy, schema, schema, "", sections)
    return "\n".join(sections)


def _policy_section(model: type[BaseModel], schema: dict[str, Any], root: dict[str, Any],
                    path: str, out: list[str]) -> None:
    title = f"`{path}`" if path else "Top level"
    out += [f"### {title}", ""]
    description = _markdown(model.__doc__) if path else ""
    if description:
        out += [description, ""]
    out += ["| Key | Type | Default | Allowed |", "| --- | --- | --- | --- |"]
    children: list[tuple[type[BaseModel], dict[str, Any], str]] = []
    required = set(schema.get("required", ()))
    fields = {field.alias or name: field for name, field in model.model_fields.items()}
    for key, prop in schema["properties"].items():
        field = fields[key]
        byte_size = _is_byte_size([*field.metadata, field.annotation])
        dotted = f"{path}.{key}" if path else key
        sub, sub_schema, mapped = _submodel(field.annotation, prop, root)
        if sub is not None and sub_schema is not None:
            children.append((sub, sub_schema, f"{dotted}.<name>" if mapped else dotted))
        kind = _type_text(prop, byte_size)
        default = "required" if key in required else _default_text(
            field.get_default(call_default_factory=True), byte_size)
        out.append(f"| `{dotted}` | {_cell(kind)} | {_cell(default)} | "
                   f"{_cell(_allowed_text(prop, byte_size))} |")
    out.append("")
    for sub, sub_schema, sub_path in children:
        _policy_section(sub, sub_schema, root, sub_path, out)


def _is_byte_size(items: list[Any]) -> bool:
    """Whether a field (its metadata, or a member of its union) is parsed as a byte size."""
    for item in items:
        if getattr(item, "func", None) is parse_byte_size:
            return True
        inner = [*getattr(item, "__metadata__", ()), *getattr(item, "__args__", ())]
        if inner and _is_byte_size(inner):
            return True
    return False


def _resolve(prop: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref")
    return root["$defs"][ref.rsplit("/", 1)[-1]] if ref else prop


def _submodel(annotation: Any, prop: dict[str, Any], root: dict[str, Any],
              ) -> tuple[type[BaseModel] | None, dict[str, Any] | None, bool]:
    """The model a key holds (a section, an optional section, or a mapping of them)."""
    for candidate in [prop, *prop.get("anyOf", ())]:
        if "$ref" in candidate:
            return _model_named(annotation, candidate["$ref"]), _resolve(candidate, root), False
        values = candidate.get("additionalProperties")
        if isinstance(values, dict) and "$ref" in values:
            return _model_named(annotation, values["$ref"]), _resolve(values, root), True
    return None, None, False


def _model_named(annotation: Any, ref: str) -> type[BaseModel]:
    name = ref.rsplit("/", 1)[-1]
    stack = [annotation]
    while stack:
        item = stack.pop()
        if isinstance(item, type) and issubclass(item, BaseModel) and item.__name__ == name:
            return item
        stack.extend(getattr(item, "__args__", ()))
    raise LookupError(f"no model {name} in {annotation!r}")


def _type_text(prop: dict[str, Any], byte_size: bool) -> str:
    if byte_size:
        nullable = any(option.get("type") == "null" for option in prop.get("anyOf", ()))
        return "byte size or null" if nullable else "byte size"
    options = prop.get("anyOf")
    if options:
        return " or ".join(_type_text(option, False) for option in options)
    if "$ref" in prop:
        return "section"
    if "enum" in prop or "const" in prop:
        return "choice"
    kind = prop.get("type", "any")
    if kind == "object":
        values = prop.get("additionalProperties")
        return "mapping of sections" if isinstance(values, dict) and "$ref" in values \
            else "mapping"
    if kind == "array":
        return f"list of {_type_text(prop.get('items', {}), False)}"
    return {"integer": "int", "number": "float", "boolean": "bool", "string": "str",
            "null": "null"}.get(kind, kind)


def _default_text(value: Any, byte_size: bool) -> str:
    if byte_size and isinstance(value, int):
        return f"`{_byte_text(value)}`"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, dict) and not value:
        return "`{}`"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return f"`[{', '.join(map(str, value))}]`"
    return f"`{value}`"


def _byte_text(value: int) -> str:
    """The shortest way to write ``value`` with a unit ``parse_byte_size`` reads."""
    units = {"PiB": 2**50, "TiB": 2**40, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10,
             "TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
    texts = [f"{value // size}{unit}" for unit, size in units.items() if value % size == 0]
    return min([str(value), *texts], key=len)


_BOUNDS = {"minimum": "≥", "ge": "≥", "exclusiveMinimum": ">", "gt": ">",
           "maximum": "≤", "le": "≤", "exclusiveMaximum": "<", "lt": "<"}
"""JSON-schema bounds; pydantic writes ``ge``/``le`` where a validator runs before them."""


def _allowed_text(prop: dict[str, Any], byte_size: bool) -> str:
    parts: list[str] = []
    for option in prop.get("anyOf", [prop]):
        if "enum" in option:
            parts.append(", ".join(f"`{_json(v)}`" for v in option["enum"]))
        if "const" in option:
            parts.append(f"`{_json(option['const'])}`")
        bounds = [f"{sign} {_number(option[key], byte_size)}"
                  for key, sign in _BOUNDS.items() if key in option]
        if bounds:
            parts.append(", ".join(bounds))
        if option.get("type") == "array" and "maxLength" in option:
            parts.append(f"at most {option['maxLength']} items")
        elif "maxLength" in option:
            parts.append(f"{option.get('minLength', 0)}..{option['maxLength']} characters")
        if "maxItems" in option:
            parts.append(f"at most {option['maxItems']} items")
        if "maxProperties" in option:
            parts.append(f"at most {option['maxProperties']} entries")
    return "; ".join(parts) or "—"


def _json(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else str(value)


def _number(value: float, byte_size: bool) -> str:
    if byte_size and isinstance(value, int):
        return _byte_text(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and value >= 2**20 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if isinstance(value, int) and value >= 10**6 and str(value).rstrip("0") == "1":
        return f"10^{len(str(value)) - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- the command line ------------------------------------------------------------------------

def cli_reference() -> str:
    """One section per subcommand (``ckptpilot peer serve`` included): usage, help, options."""
    out: list[str] = []
    for name, parser, help_text in _subcommands(build_parser(), "ckptpilot"):
        out += [f"### `{name}`", "", _cell(help_text[0].upper() + help_text[1:]) + ".", "",
                "```text", _usage(parser), "```", ""]
        rows = [_option_row(action) for action in parser._actions
                if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)]
        if rows:
            out += ["| Option | Default | Meaning |", "| --- | --- | --- |", *rows, ""]
    return "\n".join(out)


def _usage(parser: argparse.ArgumentParser) -> str:
    """argparse's usage without its ``usage: `` prefix, continuation lines shifted to match."""
    prefix = "usage: "
    return parser.format_usage().strip().removeprefix(prefix).replace(
        "\n" + " " * len(prefix), "\n")


def _subcommands(parser: argparse.ArgumentParser, prog: str,
                 ) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """Every leaf subcommand, depth first, as (``ckptpilot peer serve``, parser, help)."""
    found: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            nested = _subcommands(sub, f"{prog} {name}")
            found += nested or [(f"{prog} {name}", sub, helps[name])]
    return found


def _metavar(action: argparse.Action) -> str:
    if action.metavar:
        return str(action.metavar)
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.dest.upper()


def _option_row(action: argparse.Action) -> str:
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + _metavar(action)
        flag = ", ".join(f"`{option}{metavar}`" for option in action.option_strings)
    else:
        flag = f"`{action.metavar or action.dest}`"
    if action.required:
        default = "required"
    elif action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
        default = "—"
    else:
        default = f"`{action.default}`"
    return f"| {flag} | {default} | {_cell(action.help or '')} |"
