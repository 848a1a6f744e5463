"""Attachments: the non-paged state of a layer (sliding-window rings, recurrent arrays)
as one self-describing byte string that travels as a checkpoint attachment page.

Layout:
    b"KVA1" || u32le header length || header (canonical JSON) || pad to 64 || arrays

The header names the cache class from an explicit registry (never globals(), never
pickle), and the state as a tree whose leaves are null, booleans, integers, floats,
strings or {"array": i}; arrays[i] is {"dtype", "shape", "offset", "nbytes"} into the
data section, C order, little-endian, bfloat16 as its uint16 bit patterns.
"""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from engine.cache import PagedKVCache
from engine.errors import FormatMismatch

MAGIC = b"KVA1"
ALIGN = 64
# The only classes an attachment may name. Adding one is a format decision.
CACHE_CLASSES = {cls.__name__: cls for cls in (
    KVCache, RotatingKVCache, ArraysCache, QuantizedKVCache, ChunkedKVCache, CacheList)}
_DTYPES = {
    "bfloat16": (mx.bfloat16, np.uint16), "float16": (mx.float16, np.float16),
    "float32": (mx.float32, np.float32), "int32": (mx.int32, np.int32),
    "uint32": (mx.uint32, np.uint32), "int64": (mx.int64, np.int64),
    "uint8": (mx.uint8, np.uint8), "int8": (mx.int8, np.int8), "bool": (mx.bool_, np.bool_),
}
_DTYPE_NAMES = {mx_dtype: name for name, (mx_dtype, _) in _DTYPES.items()}


# Caches whose `offset` is the number of tokens the layer has seen (a RotatingKVCache
# keeps at most its window of them, but counts all). Recurrent state (ArraysCache) and
# CacheList have no token count.
_COUNTED = (KVCache, RotatingKVCache, QuantizedKVCache, ChunkedKVCache)


def token_offset(cache) -> int | None:
    """The tokens a layer cache has seen (its mlx-lm `offset`), or None for a cache that
    keeps no count. The engine's PagedKVCache is a KVCache for this purpose."""
    if isinstance(cache, (PagedKVCache, *_COUNTED)):
        return int(cache.offset)
    return None


def _host(x: mx.array) -> np.ndarray:
    if x.dtype not in _DTYPE_NAMES:
        raise FormatMismatch(f"attachments cannot carry {x.dtype} arrays")
    # Hosts we run on are little-endian, which the layout requires.
    return np.ascontiguousarray(np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x))


def _describe(cache) -> dict:
    name = type(cache).__name__
    if CACHE_CLASSES.get(name) is not type(cache):
        raise FormatMismatch(f"cannot attach a {name}: not in the attachment class registry")
    if isinstance(cache, CacheList):
        return {"class": name, "children": [_describe(c) for c in cache.caches]}
    return {"class": name, "state": cache.state}


def encode_attachment(cache) -> bytes:
    """One cache's complete state -> attachment bytes."""
    arrays: list[np.ndarray] = []
    dtypes: list[str] = []

    def walk(node):
        if isinstance(node, mx.array):
            arrays.append(_host(node))
            dtypes.append(_DTYPE_NAMES[node.dtype])
            return {"array": len(arrays) - 1}
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return {"list": [walk(v) for v in node]}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise FormatMismatch(f"cache state holds an unsupported {type(node).__name__}")

    tree = walk(_describe(cache))
    table, offset = [], 0
    for host, dtype in zip(arrays, dtypes):
        offset = -(-offset // ALIGN) * ALIGN
        table.append({"dtype": dtype, "shape": list(host.shape), "offset": offset,
                      "nbytes": host.nbytes})
        offset += host.nbytes
    header = json.dumps({"tree": tree, "arrays": table}, sort_keys=True,
                        separators=(",", ":")).encode()
    head = MAGIC + struct.pack("<I", len(header)) + header
    data_start = -(-len(head) // ALIGN) * ALIGN
    out = bytearray(data_start + offset)
    out[: len(head)] = head
    for host, entry in zip(arrays, table):
        start = data_start + entry["offset"]
        out[start : start + host.nbytes] = host.tobytes()
    return bytes(out)


def decode_attachment(data):
    """Attachment bytes -> a new cache of the recorded class with the recorded state."""
    view = memoryview(data).cast("B")
    if bytes(view[:4]) != MAGIC:
        raise FormatMismatch("not an attachment (bad magic)")
    (header_len,) = struct.unpack_from("<I", view, 4)
    if 8 + header_len > len(view):
        raise FormatMismatch("attachment header runs past its end")
    meta = json.loads(bytes(view[8 : 8 + header_len]))
    data_start = -(-(8 + header_len) // ALIGN) * ALIGN
    arrays = []
    for entry in meta["arrays"]:
        if entry["dtype"] not in _DTYPES:
            raise FormatMismatch(f"attachment array dtype {entry['dtype']!r} is unknown")
        mx_dtype, np_dtype = _DTYPES[entry["dtype"]]
        count = int(np.prod(entry["shape"])) if entry["shape"] else 1
        start = data_start + entry["offset"]
        if start + count * np.dtype(np_dtype).itemsize > len(view):
            raise FormatMismatch("attachment array runs past its end")
        host = np.frombuffer(view, dtype=np.dtype(np_dtype).newbyteorder("<"), count=count,
                             offset=start).astype(np_dtype).reshape(entry["shape"])
        array = mx.array(host)
        arrays.append(array.view(mx.bfloat16) if mx_dtype == mx.bfloat16 else array)

    def build(node):
        if isinstance(node, dict):
            if "array" in node and len(node) == 1:
                return arrays[node["array"]]
            if "list" in node and len(node) == 1:
                return [build(v) for v in node["list"]]
            return {k: build(v) for k, v in node.items()}
        return node

    return _rebuild(build(meta["tree"]))


def _rebuild(desc: dict):
    cls = CACHE_CLASSES.get(desc.get("class"))
    if cls is None:
        raise FormatMismatch(f"attachment names unknown cache class {desc.get('class')!r}")
    if cls is CacheList:
        return CacheList(*[_rebuild(child) for child in desc["children"]])
    return cls.from_state(tuple(desc["state"]) if cls is not ArraysCache else _arrays_state(desc["state"]))


def _arrays_state(state):
    cache, left_padding, lengths = state
    return (list(cache), left_padding, lengths)
