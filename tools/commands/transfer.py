"""Commands that move checkpoints in and out: export, import (tools/portable.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tools import portable
from tools.commands.common import (
    EXIT_INCOMPATIBLE,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    DataDirOption,
    JsonOption,
    TokenOption,
    TokensFileOption,
    UrlOption,
    emit_json,
    fail,
    human_bytes,
    open_store,
    progress_bar,
    stdout,
    store_errors,
    target,
)
from tools.commands.inspect import find_checkpoint

ExportFileArgument = typer.Argument(..., metavar="FILE", help="the file to write (.safetensors)")
ImportFileArgument = typer.Argument(..., metavar="FILE", help="a file written by `kvstore export`")


def export(
    name: str = typer.Argument(..., metavar="NAME", help="checkpoint (namespace/)name"),
    file: Path = ExportFileArgument,
    mlx_lm: bool = typer.Option(False, "--mlx-lm", help="write an mlx-lm prompt-cache file instead (native and mlx-qB formats only)"),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="namespace of NAME (default: search all)"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Export a checkpoint to one portable safetensors file.

    The file holds every page as a uint8 tensor named page/<blake3>, the block table, the tokens, and the format identity and manifest in its metadata; plain `safetensors.numpy.load_file` reads it, and `kvstore import` verifies it. --mlx-lm writes what mlx_lm.models.cache.load_prompt_cache reads instead (native page formats as KVCache, mlx-qB ones as QuantizedKVCache; kXvY ones exit 4).

    Example:

        kvstore export default/system-prompt-v3 sys.safetensors
    """
    if mlx_lm and file.suffix != ".safetensors":
        fail("mlx-lm prompt-cache files must end in .safetensors (load_prompt_cache needs it)", EXIT_USAGE)
    if not file.parent.is_dir():
        fail(f"no directory {file.parent} to write {file.name} into", EXIT_NOT_FOUND)
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        ckpt = find_checkpoint(store, name, namespace)
        if not mlx_lm and store.chain_salt(ckpt.namespace) is not None:
            # tools/portable.py re-derives the file's chain keys unsalted when it reads
            # it, so such a file could never be imported: refuse before writing it.
            fail(f"{ckpt.namespace}/{ckpt.name} is in a salted namespace: a portable file of it "
                 "could not be imported yet (its chain keys are keyed by the salt); --mlx-lm "
                 "works", EXIT_INCOMPATIBLE)
        total = sum(store.page_nbytes([d for r in store.get_blocks(ckpt.chain_keys) for d in r.pages]
                                      + list(ckpt.attachments.values())))
        with progress_bar(not as_json) as bar:
            task = bar.add_task("export", total=total or None)
            advance = lambda nbytes: bar.advance(task, nbytes)  # noqa: E731
            if mlx_lm:
                doc = portable.export_mlx_lm(store, ckpt, file, progress=advance)
            else:
                doc = vars(portable.export_checkpoint(store, ckpt, file, progress=advance))
    doc = {"checkpoint": f"{ckpt.namespace}/{ckpt.name}", "kind": "mlx-lm" if mlx_lm else "portable", **doc}
    if as_json:
        emit_json(doc)
        return
    stdout.print(f"exported {doc['checkpoint']} ({doc['tokens']:,} tokens) to {doc['path']}: "
                 f"{human_bytes(doc['nbytes'])}" + ("" if mlx_lm else f", {doc['pages']} pages, "
                                                   f"{doc['blocks']} blocks"))


def import_(
    file: Path = ImportFileArgument,
    name: Optional[str] = typer.Option(None, "--name", help="store it under this name instead"),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="store it in this namespace instead"),
    replace: bool = typer.Option(False, "--replace", help="replace a checkpoint of the same name"),
    verify_only: bool = typer.Option(False, "--verify-only", help="verify the file and write nothing"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Import a portable checkpoint file, verifying every byte before writing any.

    Checks the export version, the format identity against its id, the manifest, tokens and block table against each other, and every page's length and blake3. A corrupt, foreign or newer-version file exits 4 and writes nothing; a name clash exits 5 unless --replace.

    Example:

        kvstore import sys.safetensors --namespace staging
    """
    with store_errors():
        size = file.stat().st_size if file.is_file() else 0
        with progress_bar(not as_json) as bar:
            task = bar.add_task("verify", total=size or None)
            pf = portable.read_export(file, progress=lambda n: bar.advance(task, n))
    if verify_only:
        doc = {"verified": True, "checkpoint": f"{pf.checkpoint.namespace}/{pf.checkpoint.name}",
               "format_id": pf.identity.format_id_hex, "tokens": len(pf.checkpoint.tokens),
               "pages": len(pf.page_nbytes), "page_nbytes": pf.total_page_nbytes}
    else:
        with open_store(target(data_dir, url, token, tokens_file), write=True, create=True) as store, store_errors():
            with progress_bar(not as_json) as bar:
                task = bar.add_task("import", total=pf.total_page_nbytes or None)
                doc = portable.import_export(store, pf, name=name, namespace=namespace,
                                             replace_existing=replace,
                                             progress=lambda n: bar.advance(task, n))
    if as_json:
        emit_json(doc)
    elif verify_only:
        stdout.print(f"{file}: verified {doc['checkpoint']}, {doc['tokens']:,} tokens, "
                     f"{doc['pages']} pages ({human_bytes(doc['page_nbytes'])}); nothing written")
    else:
        stdout.print(f"imported {doc['checkpoint']}: {doc['tokens']:,} tokens, {doc['blocks']} blocks "
                     f"({doc['new_blocks']} new), {doc['pages']} pages ({doc['new_pages']} new, "
                     f"{human_bytes(doc['page_nbytes'])})")
