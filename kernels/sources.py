"""The kernel source files beside these modules (.cu, .cuh, .metal, .h), read as package data.

MLX compiles one source string per kernel, so `#include "name"` lines naming a file of this
package are replaced by that file's text here, recursively (split_epilogue.h is shared by
all three split kernels this way). Other includes are left for the compiler.

A SourceTree reads one directory of such files; PACKAGE is this package's own, and
kernel_source / source_sections read it (cached). Tests hand the backends another tree (a
temporary copy with a planted error) to prove that a check fails.

nvrtc_text(text) is what the CUDA backends hand to mx.fast.cuda_kernel in place of a long
text: one `#include "<dir>/<digest>.cuh"` line naming a file that holds it. MLX 0.32's CUDA
custom kernel copies its whole header and source into a new string on every call and hashes
that string again when the node is evaluated (custom_kernel.cpp: build_kernel, and the JIT
module's name in CustomKernel::eval_gpu). On the H200 host that costs about 10 us per call
for 40 KB and 3 us for 13 KB (tools/bench/profile/issue22_source_size_h200.py); the paged
attention kernels' texts are 13-43 KB, two calls per layer and decode step. NVRTC reads the
included file from the file system only when it compiles the module.
MLX passes an input's shape, strides or ndim only where its source string names
`<input>_shape`, `_strides` or `_ndim` (it searches the string when the kernel is made), so
the include line is followed by a comment naming every such identifier of the text.
The file is named by the digest of its text, so a changed kernel is a new name in the source,
hence a new module in MLX's caches (in memory and on disk), never a stale one; and a file
whose bytes no longer match its name is written again before it is named.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import tempfile
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


# Where nvrtc_text writes its files: $KVSTORE_KERNEL_DIR ("inline": no files, every text is
# handed over whole), else $XDG_CACHE_HOME/mlx-kvstore/kernels (~/.cache when unset).
KERNEL_DIR_VARIABLE = "KVSTORE_KERNEL_DIR"
INLINE = "inline"

log = logging.getLogger(__name__)


def kernel_dir() -> Path | None:
    """The directory nvrtc_text writes to (created 0700), or None: texts go inline."""
    chosen = os.environ.get(KERNEL_DIR_VARIABLE)
    if chosen == INLINE:
        return None
    if chosen:
        return _usable_dir(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return _usable_dir(os.path.join(cache, "mlx-kvstore", "kernels"))


@lru_cache(maxsize=None)
def _usable_dir(path: str) -> Path | None:
    """path, made if absent, when only this user can write it (another user could plant
    kernel code there) and its name can stand in a quoted #include; else None, logged once."""
    directory = Path(path).absolute()
    problem = None
    if any(c in str(directory) for c in '"\\\n'):
        problem = "its name cannot be written in a quoted #include"
    else:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = directory.stat()
            if info.st_uid != os.getuid():
                problem = f"it belongs to uid {info.st_uid}, not this user ({os.getuid()})"
            elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                problem = "other users can write it"
        except OSError as exc:
            problem = f"it cannot be made or read ({exc})"
    if problem is None:
        return directory
    log.warning("kernel sources go to MLX inline, not through %s: %s (set $%s to a private "
                "directory to fix this)", directory, problem, KERNEL_DIR_VARIABLE)
    return None


def nvrtc_text(text: str) -> str:
    """`#include "<dir>/<digest>.cuh"` (and a comment naming the text's `x_shape`,
    `x_strides` and `x_ndim` identifiers) for a file holding `text` (written here when absent
    or not byte-equal to it), or `text` itself when there is no usable directory (kernel_dir)
    or the file cannot be written. The include goes where the text would have gone: in a
    header or inside a kernel body alike, since the preprocessor pastes it there."""
    directory = kernel_dir()
    if directory is None:
        return text
    data = text.encode("utf-8")
    path = directory / f"{hashlib.blake2s(data, digest_size=16).hexdigest()}.cuh"
    try:
        if not _holds(path, data):
            descriptor, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
            try:
                with os.fdopen(descriptor, "wb") as file:
                    file.write(data)
                os.replace(temporary, path)
            except BaseException:
                os.unlink(temporary)
                raise
    except OSError as exc:
        log.warning("kernel source %s could not be written (%s): handed to MLX inline", path, exc)
        return text
    named = sorted(set(_SHAPE_ARGUMENT.findall(text)))
    return f'#include "{path}"\n' + (f"// names for MLX: {' '.join(named)}\n" if named else "")


# what MLX's cuda_kernel looks for in a source to pass an input's shape, strides or ndim
_SHAPE_ARGUMENT = re.compile(r"\b\w+_(?:shape|strides|ndim)\b")


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False
