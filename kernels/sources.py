"""The kernel source files beside these modules (.cu, .cuh, .metal, .h), read as package data.

MLX compiles one source string per kernel, so `#include "name"` lines naming a file of this
package are replaced by that file's text here, recursively (split_epilogue.h is shared by
all three split kernels this way). Other includes are left for the compiler.

A SourceTree reads one directory of such files; PACKAGE is this package's own, and
kernel_source / source_sections read it (cached). Tests hand the backends another tree (a
temporary copy with a planted error) to prove that a check fails.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from pathlib import Path

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.MULTILINE)
_SECTION = re.compile(r"^//@ (\w+)\n", re.MULTILINE)


class SourceTree:
    """The kernel sources under one directory (a package resource or a plain path)."""

    def __init__(self, root):
        self.root = root

    def text(self, name: str) -> str:
        """The text of <root>/<name>, with this tree's includes pasted in."""
        text = self.root.joinpath(name).read_text(encoding="utf-8")
        return _LOCAL_INCLUDE.sub(lambda match: self.text(match.group(1)), text)

    def sections(self, name: str) -> dict[str, str]:
        """The `//@ NAME` sections of <root>/<name>, each as one line (its lines joined by
        spaces): snippets a body template takes in place of a {placeholder}."""
        pieces = _SECTION.split(self.text(name))[1:]  # name, text, name, text, ...
        return {key: " ".join(text.strip().splitlines())
                for key, text in zip(pieces[::2], pieces[1::2], strict=True)}


PACKAGE = SourceTree(resources.files("kernels"))


def source_tree(path: str | Path) -> SourceTree:
    """A tree of kernel sources in a plain directory (a copy of kernels/, say)."""
    return SourceTree(Path(path))


@lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of kernels/<name>, with this package's includes pasted in."""
    return PACKAGE.text(name)


@lru_cache(maxsize=None)
def source_sections(name: str) -> dict[str, str]:
    """PACKAGE.sections(name), cached."""
    return PACKAGE.sections(name)
