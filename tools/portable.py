"""Portable checkpoint files: one safetensors file per checkpoint, and mlx-lm files.

Portable file (export version 1). A plain safetensors file (8-byte little-endian
header length, JSON header, data), so `safetensors.numpy.load_file` reads it:

  tensors
    tokens              U32 [num_tokens]                        the checkpoint's token ids
    block_table         U8  [num_blocks, num_paged_layers, 32]  page digest per block, layer
    page/<digest hex>   U8  [page nbytes]                       one per distinct page, named
                                                                by blake3 of its bytes
  metadata (strings)
    kvstore.file             "mlx-kvstore/checkpoint"
    kvstore.export_version   "1"
    kvstore.format_id        hex of the format id
    kvstore.format_identity  the identity's canonical JSON (kvstore/format.py)
    kvstore.manifest         the checkpoint manifest (Checkpoint.to_dict, created_ns 0),
                             which carries namespace, name, chain keys, attachments
                             (name -> page digest) and user metadata

Data are laid out in that order, pages in first-mention order (blocks, then
attachments), so one checkpoint always exports to the same bytes: export, import into
another store and export again gives an identical file.

Import verifies everything before it writes anything: the file kind and export
version (a newer one is refused, never guessed), the identity against its format id,
the manifest, tokens and block table against each other (chain keys recomputed), every
page's length against its layer's format and its blake3 against its name. Any failure
raises before the first write (ExportFileError, IncompatibleFormat, UnsupportedVersion).

mlx-lm file: what mlx_lm.models.cache.save_prompt_cache writes (per full layer a
KVCache for native pages or a QuantizedKVCache for mlx-qB pages, byte for byte; the
attachment cache for other layers), with string metadata kvstore_format_id,
kvstore_checkpoint, kvstore_num_tokens and kvstore_metadata (the checkpoint's user
metadata as canonical JSON). kXvY pages are neither: converting them would be
a lossy decode, so they are refused with IncompatibleFormat.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from kvstore.errors import IncompatibleFormat, KVStoreError, UnsupportedVersion
from kvstore.fileio import AtomicFile
from kvstore.format import PACKED_FORMATS, FormatIdentity
from kvstore.ids import PageDigest
from kvstore.pages import hash_page
from kvstore.records import BlockRecord, Checkpoint, blocks_for_tokens

FILE_KIND = "mlx-kvstore/checkpoint"
EXPORT_VERSION = 1
PAGE_PREFIX = "page/"
READ_BATCH_NBYTES = 64 << 20
IMPORT_BATCH_NBYTES = 64 << 20
MAX_HEADER_NBYTES = 256 << 20
Progress = Optional[Callable[[int], None]]  # called with bytes done since the last call


class ExportFileError(KVStoreError):
    """An export file is malformed, truncated, damaged, foreign or inconsistent."""

    code = "bad_export_file"


# -- export ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    path: str
    nbytes: int
    pages: int
    blocks: int
    tokens: int
    format_id: str


def export_checkpoint(store, ckpt: Checkpoint, path: Path, progress: Progress = None) -> ExportResult:
    """Write `ckpt` as a portable file (see the module docstring). Reads pages in
    batches (zero-copy from a local Store) and streams them to the file."""
    identity = store.get_format(ckpt.format_id)
    records = store.get_blocks(ckpt.chain_keys)
    mentions = [d for r in records for d in r.pages] + [ckpt.attachments[n] for n in sorted(ckpt.attachments)]
    pages = list(dict.fromkeys(bytes(d) for d in mentions))
    sizes = store.page_nbytes(pages) if pages else []
    table = np.frombuffer(b"".join(bytes(d) for r in records for d in r.pages), dtype=np.uint8)
    table = table.reshape(len(records), len(identity.paged_layers), 32)
    tokens = np.asarray(ckpt.tokens, dtype="<u4")
    manifest = replace(ckpt, created_ns=0).to_dict()
    metadata = {
        "kvstore.file": FILE_KIND,
        "kvstore.export_version": str(EXPORT_VERSION),
        "kvstore.format_id": identity.format_id_hex,
        "kvstore.format_identity": identity.canonical().decode(),
        "kvstore.manifest": json.dumps(manifest, sort_keys=True, separators=(",", ":")),
    }
    entries = [("tokens", "U32", list(tokens.shape), tokens.nbytes),
               ("block_table", "U8", list(table.shape), table.nbytes)]
    entries += [(PAGE_PREFIX + d.hex(), "U8", [n], n) for d, n in zip(pages, sizes, strict=True)]
    header, offset = {}, 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    # <path>.partial, fsynced, renamed over path, directory fsynced; removed on any failure
    # (kvstore.fileio.AtomicFile, where the reliability suite injects I/O faults)
    with AtomicFile(path) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.write(tokens.tobytes())
        f.write(table.tobytes())
        for batch in _batches(pages, sizes, READ_BATCH_NBYTES):
            with store.get_pages(batch) as views:
                for view in views:
                    f.write(view)
                    if progress:
                        progress(len(view))
    return ExportResult(str(path), 8 + len(raw) + offset, len(pages), len(records), len(ckpt.tokens),
                        identity.format_id_hex)


def _as_mlx_lm_class(cache):
    """The cache as an instance of mlx-lm's own class, state unchanged. The file names
    each cache's class and load_prompt_cache looks that name up in mlx-lm's module, so
    an engine subclass (engine/stock.py's TrackedKVCache, which only records a later
    conversion) would make the file unreadable there."""
    import mlx_lm.models.cache as mlx_cache

    cls = type(cache)
    base = next(b for b in cls.__mro__ if getattr(mlx_cache, b.__name__, None) is b)
    if base is cls:
        return cache
    plain = base.__new__(base)
    plain.__dict__.update(vars(cache))  # the same arrays and settings, no copy
    return plain


def _batches(digests: list, sizes: list[int], max_nbytes: int):
    batch, total = [], 0
    for d, n in zip(digests, sizes, strict=True):
        if batch and total + n > max_nbytes:
            yield batch
            batch, total = [], 0
        batch.append(d)
        total += n
    if batch:
        yield batch


# -- reading and verifying -----------------------------------------------------------------------
@dataclass
class PortableFile:
    """A verified portable file: everything import needs, pages still in the file."""

    path: Path
    identity: FormatIdentity
    checkpoint: Checkpoint
    records: list[BlockRecord]
    page_nbytes: dict[bytes, int]       # digest -> raw bytes

    @property
    def total_page_nbytes(self) -> int:
        return sum(self.page_nbytes.values())


def _open(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="np")
    except (SafetensorError, ValueError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ExportFileError(f"{path} is not a readable safetensors file: {exc}") from None


def read_export(path: Path, progress: Progress = None) -> PortableFile:
    """Parse and verify a portable file completely; raises before returning anything
    if one byte of it is wrong. Nothing is written anywhere."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    handle = _open(path)
    with handle as f:
        meta = f.metadata() or {}
        if meta.get("kvstore.file") != FILE_KIND:
            raise ExportFileError(f"{path} is not an mlx-kvstore checkpoint export "
                                  "(metadata kvstore.file is missing or different)")
        version = meta.get("kvstore.export_version", "")
        if not version.isdigit():
            raise ExportFileError(f"{path}: bad export version {version!r}")
        if int(version) > EXPORT_VERSION:
            raise UnsupportedVersion(f"{path} is export version {version}; this code reads up to "
                                     f"{EXPORT_VERSION}. Upgrade mlx-kvstore")
        identity = FormatIdentity.from_json(meta.get("kvstore.format_identity", ""))
        if identity.format_id_hex != meta.get("kvstore.format_id"):
            raise IncompatibleFormat(f"{path}: the format identity hashes to {identity.format_id_hex}, "
                                     f"not to the format id {meta.get('kvstore.format_id')!r} it claims")
        try:
            ckpt = Checkpoint.from_dict(json.loads(meta.get("kvstore.manifest", "")))
        except ValueError as exc:
            raise ExportFileError(f"{path}: bad manifest: {exc}") from None
        if ckpt.format_id != identity.format_id:
            raise IncompatibleFormat(f"{path}: the manifest names format {ckpt.format_id.hex()}, "
                                     f"the file carries {identity.format_id_hex}")
        names = set(f.keys())
        for required in ("tokens", "block_table"):
            if required not in names:
                raise ExportFileError(f"{path}: tensor {required!r} is missing")
        tokens = f.get_tensor("tokens")
        if tokens.dtype != np.uint32 or tokens.ndim != 1 or tuple(int(t) for t in tokens) != ckpt.tokens:
            raise ExportFileError(f"{path}: the tokens tensor differs from the manifest's tokens")
        table = f.get_tensor("block_table")
        paged = identity.paged_layers
        want_shape = (len(ckpt.chain_keys), len(paged), 32)
        if table.dtype != np.uint8 or table.shape != want_shape:
            raise ExportFileError(f"{path}: block_table is {table.dtype}{table.shape}, expected uint8{want_shape}")
        pages_per_block = [[PageDigest(bytes(table[i, j])) for j in range(len(paged))]
                           for i in range(len(ckpt.chain_keys))]
        try:
            records = blocks_for_tokens(identity.format_id, ckpt.namespace, ckpt.tokens,
                                        identity.block_size_tokens, pages_per_block)
        except ValueError as exc:
            raise ExportFileError(f"{path}: tokens and block table disagree: {exc}") from None
        if tuple(r.key for r in records) != tuple(ckpt.chain_keys):
            raise ExportFileError(f"{path}: the block table and tokens do not hash to the manifest's "
                                  "chain keys")
        # every page: expected length per (layer, tokens); attachments: any length
        expected: dict[bytes, Optional[int]] = {}
        for r in records:
            for layer, d in zip(paged, r.pages, strict=True):
                n = identity.layers[layer].page_nbytes(len(r.tokens))
                if expected.setdefault(bytes(d), n) != n:
                    raise ExportFileError(f"{path}: page {d.hex()} is named by layers of different sizes")
        for d in ckpt.attachments.values():
            expected.setdefault(bytes(d), None)
        page_names = {n for n in names if n.startswith(PAGE_PREFIX)}
        extra = names - page_names - {"tokens", "block_table"}
        wanted = {PAGE_PREFIX + d.hex() for d in expected}
        if extra or page_names != wanted:
            missing = sorted(wanted - page_names)[:3]
            unknown = sorted((page_names - wanted) | extra)[:3]
            raise ExportFileError(f"{path}: the pages in the file are not the pages the checkpoint "
                                  f"names (missing {missing}, unexpected {unknown})")
        sizes = {}
        for digest, want in expected.items():
            data = f.get_tensor(PAGE_PREFIX + digest.hex())
            if data.dtype != np.uint8 or data.ndim != 1:
                raise ExportFileError(f"{path}: page {digest.hex()} is {data.dtype}{data.shape}, not uint8 [n]")
            if want is not None and data.nbytes != want:
                raise ExportFileError(f"{path}: page {digest.hex()} holds {data.nbytes} bytes; its "
                                      f"layer's format needs {want}")
            actual = hash_page(data.data)
            if bytes(actual) != digest:
                raise ExportFileError(f"{path}: page {digest.hex()} is corrupt (its bytes hash to "
                                      f"{actual.hex()})")
            sizes[digest] = data.nbytes
            if progress:
                progress(data.nbytes)
    return PortableFile(path, identity, ckpt, records, sizes)


def import_export(store, pf: PortableFile, *, name: Optional[str] = None,
                  namespace: Optional[str] = None, replace_existing: bool = False,
                  progress: Progress = None) -> dict:
    """Write a verified file into `store`: format, missing pages, block records, then
    the checkpoint (pinning its blocks). A name clash is refused before any write."""
    from kvstore.errors import AlreadyExists, NotFound

    ckpt = pf.checkpoint
    name = name or ckpt.name
    namespace = namespace or ckpt.namespace
    if not replace_existing:
        try:
            store.get_checkpoint(namespace, name)
        except NotFound:
            pass
        else:
            raise AlreadyExists(f"checkpoint {namespace}/{name} exists; pass --replace or --name")
    records = pf.records
    if namespace != ckpt.namespace:  # chain keys are salted by namespace: rechain
        records = blocks_for_tokens(pf.identity.format_id, namespace, ckpt.tokens,
                                    pf.identity.block_size_tokens, [r.pages for r in records])
    fid = store.put_format(pf.identity)
    absent = {bytes(d) for d in store.missing(list(pf.page_nbytes))}
    written = 0
    with _open(pf.path) as f:
        batch, total = {}, 0
        for digest in pf.page_nbytes:
            if digest not in absent:
                if progress:
                    progress(pf.page_nbytes[digest])
                continue
            data = f.get_tensor(PAGE_PREFIX + digest.hex())
            batch[digest] = data.tobytes()
            total += data.nbytes
            if total >= IMPORT_BATCH_NBYTES:
                written += store.put_pages(batch).new
                if progress:
                    progress(total)
                batch, total = {}, 0
        if batch:
            written += store.put_pages(batch).new
            if progress:
                progress(total)
    commit = store.commit_blocks(records)
    created = store.create_checkpoint(
        Checkpoint(name, namespace, fid, ckpt.tokens, tuple(r.key for r in records),
                   ckpt.attachments, ckpt.metadata), replace=replace_existing)
    return {"checkpoint": f"{created.namespace}/{created.name}", "format_id": pf.identity.format_id_hex,
            "tokens": len(ckpt.tokens), "blocks": len(records), "new_blocks": commit.new,
            "pages": len(pf.page_nbytes), "new_pages": written,
            "page_nbytes": pf.total_page_nbytes}


# -- mlx-lm prompt-cache files ------------------------------------------------------------------
def export_mlx_lm(store, ckpt: Checkpoint, path: Path, progress: Progress = None) -> dict:
    """Write a file mlx_lm.models.cache.load_prompt_cache reads (native and mlx-qB
    formats: KVCache and QuantizedKVCache layers)."""
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    from engine.attachments import decode_attachment
    from engine.formats import page_specs
    from engine.restore import kvcache_from_pages, quantized_kvcache_from_pages

    identity = store.get_format(ckpt.format_id)
    packed = sorted({identity.layers[i].page_format for i in identity.paged_layers
                     if identity.layers[i].page_format in PACKED_FORMATS})
    if packed:
        raise IncompatibleFormat(
            f"checkpoint {ckpt.namespace}/{ckpt.name} is stored as {', '.join(packed)}; an mlx-lm "
            "prompt cache holds native K/V (KVCache) or mlx's own quantization (QuantizedKVCache, "
            "mlx-qB pages). Export the portable file instead (without --mlx-lm)")
    by_layer = {}
    for name, digest in ckpt.attachments.items():
        kind, _, index = name.partition(".")
        if index.isdigit():
            by_layer[int(index)] = digest
    unpaged = [i for i, layer in enumerate(identity.layers) if not layer.paged and i not in by_layer]
    if unpaged:
        raise IncompatibleFormat(f"layers {unpaged} have no pages and no attachment in this checkpoint")
    records = store.get_blocks(ckpt.chain_keys)
    specs = page_specs(identity)
    paged = identity.paged_layers
    caches: list = [None] * len(identity.layers)
    digests = [d for r in records for d in r.pages]
    attachment_layers = sorted(i for i in by_layer if not identity.layers[i].paged)
    with store.get_pages(digests + [by_layer[i] for i in attachment_layers]) as views:
        for j, layer in enumerate(paged):
            pages = [views[i * len(paged) + j] for i in range(len(records))]
            build = (quantized_kvcache_from_pages if specs[layer].format.mlx_affine
                     else kvcache_from_pages)
            caches[layer] = build(specs[layer], pages)
            if progress:
                progress(sum(len(v) for v in pages))
        for k, layer in enumerate(attachment_layers):
            caches[layer] = decode_attachment(views[len(digests) + k])
        mx.eval([c.state for c in caches])
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError("an mlx-lm prompt cache file name must end in .safetensors")
    # mlx-lm metadata are strings: the checkpoint's user metadata go as canonical JSON
    caches = [_as_mlx_lm_class(c) for c in caches]
    save_prompt_cache(str(path), caches, metadata={
        "kvstore_format_id": identity.format_id_hex, "kvstore_checkpoint": f"{ckpt.namespace}/{ckpt.name}",
        "kvstore_num_tokens": str(len(ckpt.tokens)),
        "kvstore_metadata": json.dumps(dict(ckpt.metadata), sort_keys=True, separators=(",", ":"))})
    return {"path": str(path), "nbytes": path.stat().st_size, "layers": len(caches),
            "tokens": len(ckpt.tokens), "format_id": identity.format_id_hex}
