"""Read-only commands: ls, show, formats, stats."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvstore.format import FormatIdentity, diff
from tools import inventory
from tools.commands.common import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    DataDirOption,
    JsonOption,
    TokenOption,
    TokensFileOption,
    UrlOption,
    emit_json,
    escape,
    fail,
    human_age,
    human_bytes,
    open_store,
    stdout,
    store_errors,
    target,
)

SORT_KEYS = {
    "name": lambda e: (e.namespace, e.name),
    "tokens": lambda e: e.tokens,
    "bytes": lambda e: e.logical_nbytes,
    "stored": lambda e: e.stored_nbytes or 0,
    "age": lambda e: -e.created_ns,
    "used": lambda e: -(e.last_used_ns or 0),
}


def ls(
    kind: str = typer.Option("all", "--kind", help="checkpoint, prefix or all"),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="only this namespace"),
    model: Optional[str] = typer.Option(None, "--model", help="only model ids containing this"),
    page_format: Optional[str] = typer.Option(None, "--format", help="only this page format, e.g. k8v4"),
    pinned: Optional[bool] = typer.Option(None, "--pinned/--evictable", help="only pinned, or only evictable entries"),
    sort: str = typer.Option("name", "--sort", help="name, tokens, bytes, stored, age or used"),
    reverse: bool = typer.Option(False, "--reverse", "-r", help="reverse the order"),
    limit: int = typer.Option(0, "--limit", min=0, help="show at most this many rows (0: all)"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """List checkpoints and stored prefixes.

    One row per checkpoint and per stored prefix (a chain of blocks ending in a block with no child): name, namespace, model, page format, tokens, bytes (logical: what a restore reads; stored: on disk, distinct pages), pinned or evictable, age and last use. Prefixes are listed for a local --data-dir only.

    Example:

        kvstore ls --kind checkpoint --sort bytes -r --limit 10
    """
    if kind not in ("all", "checkpoint", "prefix"):
        fail(f"--kind must be checkpoint, prefix or all, not {kind!r}", EXIT_USAGE)
    if sort not in SORT_KEYS:
        fail(f"--sort must be one of {', '.join(SORT_KEYS)}, not {sort!r}", EXIT_USAGE)
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        rows, notes = inventory.entries(store, prefixes=kind != "checkpoint")
    rows = [e for e in rows
            if (kind == "all" or e.kind == kind)
            and (namespace is None or e.namespace == namespace)
            and (model is None or model in e.model_id)
            and (page_format is None or page_format in e.page_format.split("+"))
            and (pinned is None or e.pinned == pinned)]
    rows.sort(key=SORT_KEYS[sort], reverse=reverse)
    if limit:
        rows = rows[:limit]
    if as_json:
        emit_json({"entries": [e.to_dict() for e in rows], "notes": notes})
        return
    table = Table(box=None, header_style="bold")
    for column in ("kind", "namespace/name", "model", "format", "tokens", "logical",
                   "stored", "pinned", "age", "used"):
        table.add_column(column, no_wrap=True,
                         justify="right" if column in ("tokens", "logical", "stored", "age", "used") else "left")
    for e in rows:
        name = e.name if e.kind == "checkpoint" else e.name[:16]
        table.add_row(e.kind, escape(f"{e.namespace}/{name}"), escape(e.model_id), e.page_format,
                      f"{e.tokens:,}", human_bytes(e.logical_nbytes), human_bytes(e.stored_nbytes),
                      "pinned" if e.pinned else "evictable", human_age(e.age_s),
                      human_age(e.idle_s) + " ago" if e.idle_s is not None else "-")
    stdout.print(table)
    stdout.print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'}")
    for note in notes:
        stdout.print(f"note: {note}", style="dim")


def show(
    what: str = typer.Argument(..., metavar="NAME|CHAIN_KEY|DIGEST",
                               help="a checkpoint (namespace/)name, a block chain key, a page digest or a format id (64 hex)"),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n", help="namespace of a checkpoint NAME (default: search all)"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Show one checkpoint, block, page or format in full.

    A checkpoint shows its manifest, its format identity (pretty and raw canonical JSON), the per-layer page table (one row per block, one digest per paged layer), attachments and what it references. A 64-hex argument is tried as a block chain key, then a page digest, then a format id.

    Example:

        kvstore show default/system-prompt-v3
    """
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        raw = inventory.parse_hex32(what)
        doc = None
        if raw is not None:
            doc = _show_hex(store, raw)
        if doc is None:
            doc = _show_checkpoint(store, what, namespace)
    if as_json:
        emit_json(doc)
        return
    _print_doc(doc)


def find_checkpoint(store, what: str, namespace: Optional[str]):
    if "/" in what:
        namespace, _, what = what.partition("/")
    if namespace is not None:
        return store.get_checkpoint(namespace, what)
    matches = [c for c in store.list_checkpoints() if c.name == what]
    if len(matches) > 1:
        fail(f"{len(matches)} checkpoints are named {what!r} "
             f"({', '.join(c.namespace for c in matches)}); pass namespace/name", EXIT_USAGE)
    if not matches:
        fail(f"no checkpoint, block, page or format is named {what!r}", EXIT_NOT_FOUND)
    return matches[0]


def _identity_doc(identity: FormatIdentity) -> dict:
    return {"format_id": identity.format_id_hex, "identity": identity.to_dict(),
            "canonical": identity.canonical().decode()}


def _show_checkpoint(store, what: str, namespace: Optional[str]) -> dict:
    ckpt = find_checkpoint(store, what, namespace)
    identity = store.get_format(ckpt.format_id)
    records = store.get_blocks(ckpt.chain_keys)
    digests = [d for r in records for d in r.pages] + list(ckpt.attachments.values())
    sizes = inventory.page_sizes(store, digests)
    paged = identity.paged_layers
    page_table = [{"block": i, "chain_key": r.key.hex(), "tokens": len(r.tokens),
                   "pages": [{"layer": layer, "digest": d.hex(), "raw_nbytes": sizes.get(bytes(d), (None, None))[0],
                              "stored_nbytes": sizes.get(bytes(d), (None, None))[1]}
                             for layer, d in zip(paged, r.pages, strict=True)]}
                  for i, r in enumerate(records)]
    manifest = ckpt.to_dict()
    manifest.pop("tokens_u32le_b64", None)
    entry = inventory.checkpoint_entry(store, ckpt, {identity.format_id: identity})
    return {"kind": "checkpoint", "manifest": manifest, "tokens_head": list(ckpt.tokens[:16]),
            "summary": entry.to_dict(), "format": _identity_doc(identity),
            "page_table": page_table,
            "attachments": {name: {"digest": d.hex(), "raw_nbytes": sizes.get(bytes(d), (None, None))[0]}
                            for name, d in sorted(ckpt.attachments.items())},
            "references": {"pins_blocks": [k.hex() for k in ckpt.chain_keys],
                           "pages": len(set(bytes(d) for d in digests))}}


def _show_hex(store, raw: bytes) -> Optional[dict]:
    try:  # the record, also when a page it names is damaged (has_blocks says False then)
        record = store.get_blocks([raw])[0]
    except KeyError:  # NotFound
        record = None
    if record is not None:
        identity = store.get_format(record.format_id)
        sizes = inventory.page_sizes(store, record.pages)
        doc = {"kind": "block", "chain_key": raw.hex(), "namespace": record.namespace,
               "format_id": record.format_id.hex(), "parent": record.parent.hex(),
               "is_root": record.is_root, "tokens": list(record.tokens),
               "created_ns": record.created_ns, "last_used_ns": record.last_used_ns,
               "pages": [{"layer": layer, "digest": d.hex(), "raw_nbytes": sizes.get(bytes(d), (None, None))[0],
                          "stored_nbytes": sizes.get(bytes(d), (None, None))[1]}
                         for layer, d in zip(identity.paged_layers, record.pages, strict=True)],
               "format": _identity_doc(identity)}
        if inventory.local_only(store):
            doc["references"] = inventory.referencing(store, raw)
            doc["pin_count"] = inventory.pins(store).get(raw, 0)
        return doc
    sizes = inventory.page_sizes(store, [raw])
    if raw in sizes:
        doc = {"kind": "page", "digest": raw.hex(), "raw_nbytes": sizes[raw][0],
               "stored_nbytes": sizes[raw][1]}
        if inventory.local_only(store):
            doc["refcount"] = inventory.refcount(store, raw)
            doc["references"] = inventory.referencing(store, raw)
        return doc
    try:
        return {"kind": "format", **_identity_doc(store.get_format(raw))}
    except KeyError:
        return None


def _print_doc(doc: dict) -> None:
    kind = doc["kind"]
    if kind == "checkpoint":
        m, s = doc["manifest"], doc["summary"]
        stdout.print(f"[bold]checkpoint {escape(m['namespace'])}/{escape(m['name'])}[/bold]")
        stdout.print(f"  tokens      {m['num_tokens']:,} (first: {doc['tokens_head']})")
        stdout.print(f"  blocks      {len(m['chain_keys'])}")
        stdout.print(f"  bytes       {human_bytes(s['logical_nbytes'])} logical, "
                     f"{human_bytes(s['stored_nbytes'])} stored")
        stdout.print(f"  created     {_when(m['created_ns'])}   last used {_when(s['last_used_ns'])}")
        stdout.print(f"  metadata    {escape(json.dumps(m['metadata'], sort_keys=True))}")
        _print_format(doc["format"])
        table = Table(title="page table (block x paged layer)", box=None, header_style="bold")
        table.add_column("block")
        table.add_column("chain key")
        table.add_column("tokens", justify="right")
        layers = [p["layer"] for p in doc["page_table"][0]["pages"]] if doc["page_table"] else []
        for layer in layers:
            table.add_column(f"layer {layer}")
        for row in doc["page_table"]:
            table.add_row(str(row["block"]), row["chain_key"][:16], str(row["tokens"]),
                          *[f"{p['digest'][:12]} {human_bytes(p['raw_nbytes'])}" for p in row["pages"]])
        stdout.print(table)
        if doc["attachments"]:
            stdout.print("attachments")
            for name, a in doc["attachments"].items():
                stdout.print(f"  {escape(name):<20} {a['digest']}  {human_bytes(a['raw_nbytes'])}")
        stdout.print(f"references: pins {len(doc['references']['pins_blocks'])} blocks, "
                     f"names {doc['references']['pages']} distinct pages")
    elif kind == "block":
        stdout.print(f"[bold]block {doc['chain_key']}[/bold]")
        stdout.print(f"  namespace   {doc['namespace']}")
        stdout.print(f"  parent      {'(root)' if doc['is_root'] else doc['parent']}")
        stdout.print(f"  tokens      {len(doc['tokens'])}: {doc['tokens'][:16]}")
        stdout.print(f"  created     {_when(doc['created_ns'])}   last used {_when(doc['last_used_ns'])}")
        for p in doc["pages"]:
            stdout.print(f"  layer {p['layer']:<4} {p['digest']}  {human_bytes(p['raw_nbytes'])} raw, "
                         f"{human_bytes(p['stored_nbytes'])} stored")
        if "references" in doc:
            stdout.print(f"  pinned by   {doc['pin_count']} checkpoint(s): "
                         f"{', '.join(doc['references']['checkpoints']) or '-'}")
            stdout.print(f"  children    {len(doc['references']['blocks'])}")
        _print_format(doc["format"])
    elif kind == "page":
        stdout.print(f"[bold]page {doc['digest']}[/bold]")
        stdout.print(f"  bytes       {human_bytes(doc['raw_nbytes'])} raw, {human_bytes(doc['stored_nbytes'])} stored")
        if "refcount" in doc:
            stdout.print(f"  references  {doc['refcount']}: blocks "
                         f"{', '.join(k[:16] for k in doc['references']['blocks']) or '-'}; checkpoints "
                         f"{', '.join(doc['references']['checkpoints']) or '-'}")
    else:
        _print_format(doc)


def _print_format(doc: dict) -> None:
    ident = doc["identity"]
    stdout.print(f"[bold]format {doc['format_id']}[/bold]")
    stdout.print(f"  model       {escape(ident['model_id'])} (fingerprint {ident['model_fingerprint'][:16]})")
    stdout.print(f"  tokenizer   {ident['tokenizer_fingerprint'][:16] or '-'}")
    stdout.print(f"  block size  {ident['block_size_tokens']} tokens, schema v{ident['schema_version']}")
    table = Table(box=None, header_style="bold")
    for column in ("layers", "kind", "kv heads", "k dim", "v dim", "page format", "group",
                   "scales", "rotation", "window"):
        table.add_column(column)
    for first, last, layer in _runs(ident["layers"]):
        table.add_row(f"{first}" if first == last else f"{first}-{last}", layer["kind"],
                      str(layer["kv_heads"]), str(layer["k_head_dim"]), str(layer["v_head_dim"]),
                      layer["page_format"], str(layer["group_size"] or "-"), layer["scale_dtype"] or "-",
                      layer["rotation"], str(layer["window"] or "-"))
    stdout.print(table)
    stdout.print(f"  raw: {escape(doc['canonical'])}", style="dim", soft_wrap=True)


def _runs(layers: list[dict]):
    """Consecutive equal layers folded into (first, last, layer)."""
    start = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[start]:
            yield start, i - 1, layers[start]
            start = i


def _when(ns: int) -> str:
    if not ns:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ns / 1e9))
    return f"{stamp} UTC ({human_age(time.time() - ns / 1e9)} ago)"


DiffOption = typer.Option(None, "--diff", metavar="ID",
                          help="give twice: the field diff between two formats (id or unique id prefix)")


def formats(
    diff_ids: Optional[list[str]] = DiffOption,
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """List the format identities the store knows, or diff two of them.

    Each format is one frozen record of what a page's bytes mean (model fingerprint, layer geometry, page format, group size, rotation, block size, schema version). With --diff A --diff B it prints every field that differs; the exit code is then 0 when they are equal and 1 when they differ, like diff(1).

    Example:

        kvstore formats --diff 3f2a --diff 9c01
    """
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        known = store.list_formats()
    if diff_ids:
        if len(diff_ids) != 2:
            fail("--diff takes exactly two format ids (give it twice)", EXIT_USAGE)
        a, b = (_resolve_format(known, x) for x in diff_ids)
        fields = diff(a, b)
        if as_json:
            emit_json({"a": a.format_id_hex, "b": b.format_id_hex, "equal": not fields,
                       "diff": [{"field": f, "a": x, "b": y} for f, x, y in fields]})
        else:
            stdout.print(f"a {a.format_id_hex} ({escape(a.model_id)})")
            stdout.print(f"b {b.format_id_hex} ({escape(b.model_id)})")
            if not fields:
                stdout.print("identical")
            table = Table(box=None, header_style="bold")
            for column in ("field", "a", "b"):
                table.add_column(column)
            for f, x, y in fields:
                table.add_row(f, escape(repr(x)), escape(repr(y)))
            if fields:
                stdout.print(table)
        raise typer.Exit(EXIT_PROBLEMS if fields else EXIT_OK)
    if as_json:
        emit_json({"formats": [_identity_doc(f) for f in known]})
        return
    table = Table(box=None, header_style="bold")
    for column in ("format id", "model", "block", "layers", "paged", "page format", "schema"):
        table.add_column(column)
    for f in known:
        table.add_row(f.format_id_hex[:16], escape(f.model_id), str(f.block_size_tokens),
                      str(len(f.layers)), str(len(f.paged_layers)), inventory.page_formats(f),
                      str(f.schema_version))
    stdout.print(table)
    stdout.print(f"{len(known)} format(s)")


def _resolve_format(known: list[FormatIdentity], text: str) -> FormatIdentity:
    text = text.strip().lower()
    matches = [f for f in known if f.format_id_hex.startswith(text)] if text else []
    if len(matches) != 1:
        fail(f"{len(matches)} stored formats match {text!r}; give a unique id prefix",
             EXIT_NOT_FOUND if not matches else EXIT_USAGE)
    return matches[0]


def stats(
    top: int = typer.Option(5, "--top", min=0, help="how many of the largest prefixes to list"),
    data_dir: Optional[Path] = DataDirOption, url: Optional[str] = UrlOption,
    token: Optional[str] = TokenOption, tokens_file: Optional[Path] = TokensFileOption,
    as_json: bool = JsonOption,
) -> None:
    """Usage against the budget, dedup and compression, hits, eviction and GC history.

    Hit and miss counts are the serving process's: they are meaningful with --url (the service's counters) and zero for a directory opened by this command. GC history and the largest prefixes need a local --data-dir.

    Example:

        kvstore stats --url http://127.0.0.1:8700 --json | jq .dedup_ratio
    """
    with open_store(target(data_dir, url, token, tokens_file)) as store, store_errors():
        s = store.stats().to_dict()
        rows, notes = inventory.entries(store, prefixes=True)
        history = None
        if inventory.local_only(store):
            from kvstore.gc import gc_history

            history = gc_history(store)
            from kvstore.tier.queue import read_backlog  # the S3 tier's upload queue, if any

            backlog = read_backlog(store.path)
            if backlog is not None and s.get("backlog_jobs") is None:
                s.update(backlog.to_dict())
    budget = s.get("budget_nbytes")
    s["budget_used"] = s["stored_nbytes"] / budget if budget else None
    s["hit_rate"] = s["lookup_hits"] / s["lookups"] if s["lookups"] else None
    s["token_hit_rate"] = s["tokens_matched"] / s["tokens_looked_up"] if s["tokens_looked_up"] else None
    checkpoints = [e for e in rows if e.kind == "checkpoint"]
    s["checkpoint_logical_nbytes"] = sum(e.logical_nbytes for e in checkpoints)
    s["checkpoint_sharing_ratio"] = (s["checkpoint_logical_nbytes"] / s["raw_nbytes"]
                                     if s["raw_nbytes"] else None)
    largest_kind = "prefix" if inventory.local_only(store) else "checkpoint"
    largest = sorted((e for e in rows if e.kind == largest_kind), key=lambda e: -e.logical_nbytes)[:top]
    doc = {"stats": s, "gc_history": history, "largest": [e.to_dict() for e in largest], "notes": notes}
    if as_json:
        emit_json(doc)
        return
    budget_text = f"of {human_bytes(budget)} budget ({s['budget_used']:.0%})" if budget else "(no budget set)"
    stdout.print(f"stored      {human_bytes(s['stored_nbytes'])} {budget_text}; file "
                 f"{human_bytes(s['file_nbytes'])}, map {human_bytes(s['map_nbytes'])}")
    stdout.print(f"objects     {s['page_count']:,} pages, {s['block_count']:,} blocks "
                 f"({s['pinned_block_count']:,} pinned), {s['checkpoint_count']:,} checkpoints, "
                 f"{s['format_count']} formats, {s['quarantined_count']} quarantined")
    stdout.print(f"dedup       {s['dedup_ratio']:.2f}x ({human_bytes(s['referenced_raw_nbytes'])} referenced "
                 f"/ {human_bytes(s['raw_nbytes'])} distinct raw)")
    if s["checkpoint_sharing_ratio"] is not None:
        stdout.print(f"sharing     {s['checkpoint_sharing_ratio']:.2f}x ({len(checkpoints)} checkpoints name "
                     f"{human_bytes(s['checkpoint_logical_nbytes'])} of pages; the store holds "
                     f"{human_bytes(s['raw_nbytes'])} raw)")
    stdout.print(f"compression {s['compression_ratio']:.2f}x ({human_bytes(s['raw_nbytes'])} raw "
                 f"/ {human_bytes(s['stored_nbytes'])} stored)")
    hit = f"{s['hit_rate']:.0%}" if s["hit_rate"] is not None else "-"
    stdout.print(f"lookups     {s['lookups']:,} ({s['lookup_hits']:,} hits, {hit}); tokens "
                 f"{s['tokens_matched']:,} of {s['tokens_looked_up']:,} matched")
    stdout.print(f"evicted     {s['evicted_blocks']:,} blocks, {human_bytes(s['evicted_nbytes'])} so far")
    if s.get("backlog_jobs") is not None:
        failing = f", {s['backlog_failing']} failing ({s.get('backlog_last_error') or 'retrying'})" \
            if s.get("backlog_failing") else ""
        stdout.print(f"s3 backlog  {s['backlog_jobs']:,} uploads queued ({s['backlog_pages']:,} pages, "
                     f"{s['backlog_blocks']:,} blocks, {s['backlog_checkpoints']:,} checkpoints), "
                     f"{human_bytes(s['backlog_nbytes'])}, oldest "
                     f"{human_age(s['backlog_oldest_age_s'])}{escape(failing)}")
    if history is not None:
        stdout.print(f"gc runs     {len(history)}" + (":" if history else ""))
        for h in history[-5:]:
            stdout.print(f"  {_when(h['at_ns'])}: {h['pages']} pages, {human_bytes(h['freed_nbytes'])} "
                         f"freed, {h['skipped']} skipped, grace {h['grace_s']:.0f}s")
    if largest:
        table = Table(title=f"largest {'prefixes' if largest_kind == 'prefix' else 'checkpoints'}",
                      box=None, header_style="bold")
        for column in ("name", "namespace", "tokens", "logical", "stored", "pinned"):
            table.add_column(column)
        for e in largest:
            table.add_row(escape(e.name[:16] if e.kind == "prefix" else e.name), e.namespace,
                          f"{e.tokens:,}", human_bytes(e.logical_nbytes), human_bytes(e.stored_nbytes),
                          "pinned" if e.pinned else "evictable")
        stdout.print(table)
    for note in notes:
        stdout.print(f"note: {note}", style="dim")


