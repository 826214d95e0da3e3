"""The package root's public names are spelled three times (agl_stream/__init__.py): imported for
type checkers, mapped to their modules for loading on first use, and listed in ``__all__``.
The three must agree, and every name must load to what the type checkers were told."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import agl_stream


def _type_checking_names() -> set[str]:
    tree = ast.parse(Path(agl_stream.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    names: set[str] = set()
    for node in ast.walk(block):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def test_the_lazy_table_all_and_the_type_checking_imports_name_the_same_things() -> None:
    lazy = set(agl_stream._LAZY)
    assert set(agl_stream.__all__) == lazy
    assert _type_checking_names() == lazy


def test_every_public_name_loads_from_the_module_it_is_mapped_to() -> None:
    for name, (module, attribute) in agl_stream._LAZY.items():
        assert getattr(agl_stream, name) is getattr(importlib.import_module(module), attribute), name
