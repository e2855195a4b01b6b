"""The policy file's YAML reader: a ``SafeLoader`` hardened against hostile input.

It refuses what PyYAML would turn into another exception or an unbounded cost: bytes that
are not UTF-8, integer literals too long for ``int`` (Python's digit limit), nesting deep
enough to exhaust the recursion limit, aliases that expand to a huge or cyclic value (a
"billion laughs" alias bomb: PyYAML shares aliased values, but pydantic's error messages repr
them in full), and merge keys (``<<``), whose expansion is exponential. Every refusal is a
:class:`~ckptpilot.errors.PolicyError` naming the file and line.
"""

from __future__ import annotations

import reprlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from ckptpilot.errors import PolicyError

# Limits of the YAML reader; a policy file is a few KB, about 60 values, 5 levels deep.
_MAX_FILE_BYTES = 2**20
_MAX_YAML_DEPTH = 32
_MAX_YAML_VALUES = 10_000
_MAX_INT_CHARS = 64
"""Longer integer literals are refused before ``int()``, which stops at 4300 digits."""


def read_policy_yaml(source: str) -> dict[Any, Any]:
    """The top-level mapping of the policy file ``source`` (empty for an empty file); every
    problem, from a missing file to an alias bomb, is a :class:`PolicyError` naming the file."""
    try:
        with Path(source).open("rb") as file:
            raw = file.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError as exc:
        raise PolicyError("", f"policy file not found: {source}") from exc
    except IsADirectoryError as exc:
        raise PolicyError("", f"{source} is a directory; pass the policy YAML file") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise PolicyError("", f"cannot read policy file {source}: {exc}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise PolicyError(
            "", f"{source} is over {_MAX_FILE_BYTES // 2**20} MiB; a policy file is a few KB"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise PolicyError(
            "",
            f"{source}:{line}: byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8 "
            "(comments included); save the file as UTF-8",
        ) from exc
    try:
        data = yaml.load(text, Loader=_PolicyLoader)  # a SafeLoader: builds no objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise PolicyError("", f"{where}: invalid YAML: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError("", f"{source}: invalid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise PolicyError("", f"{source}: the top level must be a mapping of keys, got {kind}")
    return data


_PATTERN_TAGS = frozenset(
    f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float", "timestamp")
)
"""Tags whose constructors only work on values that match the resolver's pattern for them."""


class _PolicyLoader(yaml.SafeLoader):
    """SafeLoader that refuses what no policy needs and what would escape as another error.

    Refused: a key repeated in one mapping (YAML would let the last one win silently), nesting
    deeper than ``_MAX_YAML_DEPTH`` (the composer recurses per level), a document whose values,
    with every alias expanded, exceed ``_MAX_YAML_VALUES`` or ``_MAX_YAML_DEPTH`` or contain
    themselves, merge keys, integer literals longer than ``_MAX_INT_CHARS``, and an explicit
    ``!!int`` / ``!!float`` / ``!!bool`` / ``!!timestamp`` on a value not written that way.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        if self._depth >= _MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {_MAX_YAML_DEPTH} levels; a policy has at most 5",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # PyYAML's int/float/bool/timestamp constructors trust the resolver's pattern; a tag
        # written out (``!!int x``) skips it and they fail with IndexError, ValueError...
        if (
            isinstance(node, yaml.ScalarNode)
            and node.tag in _PATTERN_TAGS
            and self.resolve(yaml.ScalarNode, node.value, (True, False)) != node.tag
        ):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"{reprlib.repr(node.value)} is not a valid !!{node.tag.rpartition(':')[2]}",
                node.start_mark,
            )
        return super().construct_object(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > _MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"integer literal of {len(node.value)} characters; no policy value needs more "
                f"than {_MAX_INT_CHARS}",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):  # ``!!set 0``: the base class refuses it
            return super().construct_mapping(node, deep=deep)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "merge keys (<<) are not supported; write the keys out",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # ``!!omap`` as a key: the base class refuses it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {reprlib.repr(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_PolicyLoader.add_constructor("tag:yaml.org,2002:int", _PolicyLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph that, with its aliases expanded, is too big, too deep or cyclic.

    PyYAML shares one node (and one Python value) between an anchor and its aliases, so nine
    aliases nine levels deep cost nothing to load but expand to 9**9 values for whoever
    prints them, and ``&a [*a]`` contains itself. Sizes and depths are computed once per
    node, bottom up, without recursion: alias chains can be far deeper than the text.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_nodes: set[int] = set()  # ancestors of the node being visited
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            size[id(node)] = 1 + sum(size[id(child)] for child in children)
            depth[id(node)] = 1 + max((depth[id(child)] for child in children), default=0)
            if size[id(node)] > _MAX_YAML_VALUES:
                problem = f"holds more than {_MAX_YAML_VALUES} values; a policy has about 60"
            elif depth[id(node)] > _MAX_YAML_DEPTH:
                problem = f"is nested deeper than {_MAX_YAML_DEPTH} levels; a policy has 5"
            else:
                continue
            raise yaml.composer.ComposerError(
                None, None, f"with its aliases expanded, this value {problem}", node.start_mark
            )
        if id(node) in size:
            continue
        if id(node) in open_nodes:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to a value that contains it", node.start_mark
            )
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
