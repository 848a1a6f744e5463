"""The kernel source files beside these modules (.cu, .cuh, .metal, .h), read as package data.

MLX compiles one source string per kernel, so `#include "name"` lines naming a file of this
package are replaced by that file's text here, recursively (split_epilogue.h is shared by
all three split kernels this way). Other includes are left for the compiler.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.MULTILINE)
_SECTION = re.compile(r"^//@ (\w+)\n", re.MULTILINE)


@lru_cache(maxsize=None)
def kernel_source(name: str) -> str:
    """The text of kernels/<name>, with this package's includes pasted in."""
    text = resources.files("kernels").joinpath(name).read_text(encoding="utf-8")
    return _LOCAL_INCLUDE.sub(lambda match: kernel_source(match.group(1)), text)


@lru_cache(maxsize=None)
def source_sections(name: str) -> dict[str, str]:
    """The `//@ NAME` sections of kernels/<name>, each as one line (its lines joined by
    spaces): snippets a body template takes in place of a {placeholder}."""
    pieces = _SECTION.split(kernel_source(name))[1:]  # name, text, name, text, ...
    return {key: " ".join(text.strip().splitlines()) for key, text in zip(pieces[::2], pieces[1::2], strict=True)}
