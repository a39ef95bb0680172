"""Parsing a user's YAML and JSON text strictly: a key written twice in one mapping is an error.

Both parsers keep the last of two equal keys silently, so a config that sets ``concurrency`` twice (one
line edited, an older one left further down) would run with whichever came last and nobody told."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Checked on the mapping's own keys, before ``<<`` merges are flattened in: a key that overrides
        # a merged-in one is what a merge is for.
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                earlier = first.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                break
            if earlier is not None:
                problem = f"line {line}: key {str(key)[:80]!r} appears twice (first on line {earlier})"
                raise ConstructorError(None, None, problem, key_node.start_mark)
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key written twice in one mapping (a ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: a key written twice in one object is a ``ValueError``."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key[:80]!r} appears twice in one object")
        obj[key] = value
    return obj
