"""RemoteStore: the Store protocol over the HTTP service (api/), so callers take either.

    with RemoteStore("http://127.0.0.1:8700", token="...") as store:
        fid = store.put_format(identity)
        store.put_pages({d: payload[d] for d in store.missing(payload)})
        store.commit_blocks(records)
        match = store.lookup_prefix(fid, "default", tokens)
        store.read_pages_into(digests, buffers)      # streamed straight into buffers

Transport. One httpx.Client for every control and upload request, so connections
are kept alive and reused (it is thread-safe: share one RemoteStore between threads).
Batch page reads use a kept-alive http.client connection per thread instead:
HTTPResponse.readinto hands the caller's buffer to recv_into, so page bytes go from
the socket straight into the destination. httpx's h11 parser copies every byte about
three times in 64 KiB pieces, which measured 0.45 GB/s against 1.0 GB/s this way on
the 2-core reference machine (tools/bench/http.py). With an injected httpx client
(in-process tests) reads stream through it and are copied chunk by chunk into the
buffers. Either way no bytes object per page or per batch is built.

Retries. Requests that are idempotent by the store's semantics (every read, PUT of a
page or format, missing(), commit_blocks of content-addressed records) are retried
on transport failures and 503, with backoff. Everything else (create or delete a
checkpoint, gc, evict) is retried only when the connection could not be opened, so a
request that may have reached the server is never sent twice.

Errors. Error bodies become the kvstore.errors types the embedded Store raises, with
the server's message (kvstore.wire.error_from_body); 401/403 become AccessDenied.

Same-host fast path. RemoteStore(url, token, local_dir=DIR), where DIR is the
server's store directory, opens it read-only (Store(DIR, readonly=True)) and answers
the reads of a restore from the LMDB map directly: lookup_prefix (replayed to the
server in the background so it records the use) and pages, verified as in the
server. Writes and control still go through HTTP. Reading the directory bypasses
the service's namespaces: only processes trusted with the whole store should be
given it.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, fields
from typing import Iterable, Iterator, Mapping, Sequence
from urllib.parse import quote

import httpx
import zstandard

from kvstore.check import CheckReport, Problem
from kvstore.deferred import DeferredPages, verified_now
from kvstore.errors import IntegrityError, InvalidInput, KVStoreError, NotFound, StoreIOError
from kvstore.format import FormatIdentity
from kvstore.ids import ChainKey, PageDigest, check_chain_salt, check_namespace
from kvstore.records import BlockRecord, Checkpoint
from kvstore.store import (
    CommitResult,
    EvictionReport,
    PrefixMatch,
    PutResult,
    Store,
    StoreStats,
    verified_pages,
)
from kvstore.wire import (
    PAGE_STREAM_MEDIA_TYPE,
    PageStreamReader,
    block_from_json,
    block_to_json,
    checkpoint_from_json,
    checkpoint_to_json,
    encode_stream,
    error_from_body,
    read_stream_into,
)

DIGESTS_PER_REQUEST = 8192          # under the server's default max_batch_pages
READ_BATCH_NBYTES = 256 << 20       # one batch read; under max_batch_nbytes
PARALLEL_MIN_NBYTES = 16 << 20      # smaller reads go as one stream
UPLOAD_BATCH_NBYTES = 32 << 20      # one batch upload; under the server's max_page_nbytes
SEND_PIECE_NBYTES = 256 << 10
MAX_PENDING_REPLAYS = 64            # fast-path lookups queued for the server
RETRY_STATUSES = frozenset({502, 503, 504})
COMPRESS_SAMPLE_NBYTES = 64 << 10


class AccessDenied(KVStoreError, PermissionError):
    """The service refused the token (401) or its scope (403)."""

    code = "access_denied"


@dataclass
class RemoteGCPlan:
    """What plan_gc returns over HTTP: the server's dry-run summary; execute() asks
    the server to plan again and run (GC re-checks every candidate anyway)."""

    store: "RemoteStore"
    grace_s: float
    plan: dict

    @property
    def freed_nbytes(self) -> int:
        return int(self.plan.get("unreferenced_nbytes", 0))

    def summary(self) -> dict:
        return dict(self.plan)

    def execute(self, progress=None) -> dict:
        body = self.store._post("/v1/admin/gc", {"grace_s": self.grace_s, "dry_run": False},
                                idempotent=False, timeout=None)
        return body["deleted"]


class RemoteStore:
    """The Store protocol over HTTP (see the module docstring)."""

    def __init__(self, url: str, token: str | None = None, *, local_dir=None,
                 timeout_s: float = 60.0, retries: int = 3, compress_uploads: bool = False,
                 read_streams: int = 1, upload_streams: int = 2,
                 client: httpx.Client | None = None):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._direct = None
        if client is None:
            self._direct = _DirectReader(url, headers, timeout_s)
            client = httpx.Client(base_url=url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=5.0),
                                  limits=httpx.Limits(max_keepalive_connections=8))
        else:
            client.headers.update(headers)
        self.url = url
        self._client = client
        self._retries = retries
        self._read_streams = max(1, int(read_streams))
        self._upload_streams = max(1, int(upload_streams))
        self._executor = None
        self._replayer = None
        self._replays_pending = 0
        self.last_replay_error: Exception | None = None
        self._pool_lock = threading.Lock()
        self._compress = compress_uploads
        self._formats: dict[bytes, FormatIdentity] = {}
        self._salts: dict[str, bytes | None] = {}  # namespace -> chain salt, as the service said
        self._local = Store(local_dir, readonly=True) if local_dir is not None else None

    @property
    def maps_pages(self) -> bool:
        """True only with local_dir: get_pages then yields views of the server's map;
        over HTTP it fetches every page into a buffer it allocates (kvstore/protocol.py)."""
        return self._local is not None

    def close(self) -> None:
        if self._replayer is not None:
            self._replayer.shutdown(wait=True)  # pending lookups reach the server first
        if self._executor is not None:
            self._executor.shutdown()
        self._client.close()
        if self._direct is not None:
            self._direct.close()
        if self._local is not None:
            self._local.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- transport -----------------------------------------------------------------
    def _send(self, method: str, path: str, *, idempotent: bool, **kwargs) -> httpx.Response:
        if self._direct is None:
            kwargs.pop("timeout", None)  # an injected client (tests) keeps its own
        for attempt in range(self._retries + 1):
            last = attempt == self._retries
            try:
                response = self._client.request(method, path, **kwargs)
            except httpx.ConnectError:
                if last:
                    raise
            except httpx.TransportError:
                if last or not idempotent:
                    raise
            else:
                if response.status_code < 400:
                    return response
                if not (idempotent and response.status_code in RETRY_STATUSES) or last:
                    raise _error(response)
            time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def _get(self, path: str, **kwargs):
        return self._send("GET", path, idempotent=True, **kwargs).json()

    def _post(self, path: str, body: dict, *, idempotent: bool, **kwargs):
        response = self._send("POST", path, idempotent=idempotent, json=body, **kwargs)
        return response.json() if response.content else None

    # -- formats -------------------------------------------------------------------
    def put_format(self, identity: FormatIdentity) -> bytes:
        fid = identity.format_id
        self._send("PUT", f"/v1/formats/{fid.hex()}", idempotent=True, json=identity.to_dict())
        self._formats[fid] = identity
        return fid

    def get_format(self, format_id) -> FormatIdentity:
        fid = _format_id_bytes(format_id)
        if fid not in self._formats:
            self._formats[fid] = FormatIdentity.from_dict(self._get(f"/v1/formats/{fid.hex()}"))
        return self._formats[fid]

    def list_formats(self) -> list[FormatIdentity]:
        return [FormatIdentity.from_dict(f) for f in self._get("/v1/formats")["formats"]]

    # -- pages ---------------------------------------------------------------------
    def missing(self, digests: Iterable) -> list[PageDigest]:
        wanted = [PageDigest.coerce(d).hex() for d in digests]
        out: list[PageDigest] = []
        for start in range(0, len(wanted), DIGESTS_PER_REQUEST):
            body = self._post("/v1/pages/missing",
                              {"digests": wanted[start : start + DIGESTS_PER_REQUEST]},
                              idempotent=True)
            out += [PageDigest.parse(d) for d in body["missing"]]
        return out

    def put_pages(self, pages: Mapping | Iterable[tuple]) -> PutResult:
        """As Store.put_pages: every digest is checked before anything is sent, so one
        mismatch refuses the whole call with nothing written. Pages travel in batches
        of up to UPLOAD_BATCH_NBYTES as one page stream each (POST /v1/pages/put: one
        request and one durable write per batch); a failure part-way leaves earlier
        batches stored (unreferenced until committed; GC reclaims them after its
        grace period)."""
        checked = verified_pages(pages)
        sizes = [memoryview(data).nbytes for _, data in checked]
        batches = [checked[a:b] for a, b in _read_batches(sizes, UPLOAD_BATCH_NBYTES)]
        if len(batches) > 1 and self._upload_streams > 1:
            # two in flight: the server hashes and commits one batch while the next
            # one arrives (blake3 and the LMDB sync release the GIL)
            with ThreadPoolExecutor(self._upload_streams, thread_name_prefix="kvstore-put") as pool:
                results = list(pool.map(self._put_batch, batches))
        else:
            results = [self._put_batch(batch) for batch in batches]
        return PutResult(sum(r["new"] for r in results), sum(r["existing"] for r in results),
                         sum(r["stored_nbytes"] for r in results))

    def _put_batch(self, batch: list) -> dict:
        body, headers = _upload_body(encode_stream(batch), self._compress)
        headers["Content-Type"] = PAGE_STREAM_MEDIA_TYPE
        headers["Content-Length"] = str(len(body))
        # pieces rather than one bytes: httpcore re-slices (copies) what is left of a
        # bytes after every partial send, quadratic in the body size
        pieces = [memoryview(body)[i : i + SEND_PIECE_NBYTES]
                  for i in range(0, len(body), SEND_PIECE_NBYTES)]
        return self._send("POST", "/v1/pages/put", idempotent=True, content=pieces,
                          headers=headers).json()

    def put_page(self, digest, data) -> bool:
        """One page as a raw PUT (what curl would send); True when it was new."""
        digest = PageDigest.coerce(digest)
        body, headers = _upload_body(data, self._compress)
        return self._send("PUT", f"/v1/pages/{digest.hex()}", idempotent=True,
                          content=body, headers=headers).json()["new"]

    def page_nbytes(self, digests: Sequence) -> list[int]:
        if self._local is not None:
            return self._local.page_nbytes(digests)
        wanted = [PageDigest.coerce(d).hex() for d in digests]
        out: list[int] = []
        for start in range(0, len(wanted), DIGESTS_PER_REQUEST):
            out += self._post("/v1/pages/nbytes",
                              {"digests": wanted[start : start + DIGESTS_PER_REQUEST]},
                              idempotent=True)["nbytes"]
        return out

    @contextmanager
    def get_pages(self, digests: Sequence) -> Iterator[list]:
        """Yields one read-only buffer per digest. Over HTTP they are received copies;
        with local_dir they are the store's zero-copy views."""
        if self._local is not None:
            with ExitStack() as stack:
                with self._local_reads():
                    views = stack.enter_context(self._local.get_pages(digests))
                yield views
            return
        buffers = [bytearray(n) for n in self.page_nbytes(digests)]
        self.read_pages_into(digests, buffers)
        yield [memoryview(b).toreadonly() for b in buffers]

    @contextmanager
    def _local_reads(self):
        """A read through local_dir that finds a damaged page cannot quarantine it (the
        map is open read-only), so the server is asked for that page: its own read
        finds the damage and quarantines it, and the next lookup stops before it, as on
        the server. The caller gets the local IntegrityError either way."""
        try:
            yield
        except IntegrityError as exc:
            try:
                digest = PageDigest.parse(exc.digest)
                self._read_batch([digest], [bytearray(self._local.page_nbytes([digest])[0])])
            except (KVStoreError, httpx.HTTPError, OSError):
                pass  # the server found it too (or cannot be reached): the local error stands
            raise

    def get_pages_deferred(self, digests: Sequence) -> AbstractContextManager[DeferredPages]:
        """get_pages' views, verified as they always are (here, or by the local store
        through local_dir): they owe nothing (kvstore/deferred.py)."""
        return verified_now(self.get_pages, digests)

    def read_pages(self, digests: Sequence) -> list[bytes]:
        with self.get_pages(digests) as views:
            return [bytes(v) for v in views]

    def read_pages_into(self, digests: Sequence, buffers: Sequence) -> int:
        """Copy each verified page into the matching writable buffer (exact length)."""
        if len(buffers) != len(digests):
            raise InvalidInput(f"{len(digests)} digests but {len(buffers)} buffers")
        if self._local is not None:
            with self._local_reads():
                return self._local.read_pages_into(digests, buffers)
        digests = [PageDigest.coerce(d) for d in digests]
        sizes = [memoryview(b).nbytes for b in buffers]
        batch_nbytes = READ_BATCH_NBYTES
        if self._direct is not None and self._read_streams > 1:
            # several concurrent streams: the server verifies one batch while it sends
            # another, and both ends use both cores
            batch_nbytes = max(PARALLEL_MIN_NBYTES, min(batch_nbytes, -(-sum(sizes) // self._read_streams)))
        batches = list(_read_batches(sizes, batch_nbytes))
        if len(batches) == 1 or self._direct is None:
            return sum(self._read_batch(digests[a:b], buffers[a:b]) for a, b in batches)
        futures = [self._pool().submit(self._read_batch, digests[a:b], buffers[a:b])
                   for a, b in batches]
        return sum(f.result() for f in futures)

    def _pool(self):
        with self._pool_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._read_streams,
                                                    thread_name_prefix="kvstore-read")
            return self._executor

    def _read_batch(self, digests: list[PageDigest], buffers: Sequence) -> int:
        body = {"digests": [d.hex() for d in digests]}
        for attempt in range(self._retries + 1):
            if self._direct is not None:
                try:
                    return self._direct.read(body, digests, buffers)
                except _Retry as exc:
                    if attempt == self._retries:
                        raise StoreIOError(f"batch page read failed: {exc.__cause__}") from None
                    time.sleep(0.05 * 2**attempt)
                    continue
            try:
                with self._client.stream("POST", "/v1/pages/get", json=body) as response:
                    if response.status_code >= 400:
                        response.read()
                        if response.status_code in RETRY_STATUSES and attempt < self._retries:
                            continue
                        raise _error(response)
                    media = response.headers.get("content-type", "")
                    if not media.startswith(PAGE_STREAM_MEDIA_TYPE):
                        raise StoreIOError(f"expected a page stream, got {media!r}")
                    reader = PageStreamReader(digests, buffers)
                    for chunk in response.iter_raw():
                        reader.feed(chunk)
                    return reader.finish()
            except httpx.TransportError:
                if attempt == self._retries:
                    raise
            time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    # -- blocks and prefixes -----------------------------------------------------------
    def commit_blocks(self, blocks: Sequence[BlockRecord]) -> CommitResult:
        payload = [block_to_json(b, with_times=False) for b in blocks]
        body = self._post("/v1/blocks/commit", {"blocks": payload}, idempotent=True)
        return CommitResult(body["new"], body["existing"], body["evicted_blocks"])

    def chain_salt(self, namespace: str) -> bytes | None:
        """The namespace's chain salt as the service keeps it (GET
        /v1/namespaces/{namespace}/chain-salt; a token learns only its own namespace's),
        asked once per namespace and kept for this client's life."""
        if namespace not in self._salts:
            try:
                body = self._get(f"/v1/namespaces/{_segment(check_namespace(namespace))}/chain-salt")
            except NotFound:  # a server older than salts: every namespace is unsalted
                body = {}
            salt = body.get("salt")
            self._salts[namespace] = check_chain_salt(bytes.fromhex(salt)) if salt else None
        return self._salts[namespace]

    def _block(self, data: dict) -> BlockRecord:
        return block_from_json(data, self.chain_salt(data["namespace"]))

    def get_blocks(self, keys: Sequence) -> list[BlockRecord]:
        wanted = [ChainKey.coerce(k).hex() for k in keys]
        body = self._post("/v1/blocks/get", {"keys": wanted}, idempotent=True)
        return [self._block(b) for b in body["blocks"]]

    def list_blocks(self, namespace: str | None = None, *, after=None,
                    limit: int = 1000) -> list[BlockRecord]:
        params: dict = {"limit": limit}
        if namespace is not None:
            params["namespace"] = namespace
        if after is not None:
            params["after"] = ChainKey.coerce(after).hex()
        body = self._get("/v1/blocks", params=params)
        return [self._block(b) for b in body["blocks"]]

    def find_blocks(self, keys: Sequence) -> list[BlockRecord | None]:
        """The record of each key, or None where absent (record presence only). One
        request when all are present; else one per key (the service's /v1/blocks/get
        refuses a batch with an absent key)."""
        keys = [ChainKey.coerce(k) for k in keys]
        try:
            return list(self.get_blocks(keys)) if keys else []
        except NotFound:
            out: list[BlockRecord | None] = []
            for k in keys:
                try:
                    out.append(self.get_blocks([k])[0])
                except NotFound:
                    out.append(None)
            return out

    def has_blocks(self, keys: Sequence) -> list[bool]:
        """As Store.has_blocks: True only for a block whose record and every page are
        stored (the server answers)."""
        wanted = [ChainKey.coerce(k).hex() for k in keys]
        return self._post("/v1/blocks/has", {"keys": wanted}, idempotent=True)["present"]

    def lookup_prefix(self, format_id, namespace: str, tokens: Sequence[int], *,
                      max_tokens: int | None = None) -> PrefixMatch:
        """With local_dir the lookup is answered from the map (the critical path of a
        restore stays off the network) and replayed to the server in the background,
        so it still records the use: LRU order and hit statistics. That is the store's
        own contract for touches (kept in memory, written later; losing one only ages
        the LRU order). A replay the server refuses is kept in last_replay_error. The
        namespace's chain salt is asked of the server first (chain_salt): a namespace
        the token may not access is AccessDenied at once, and a salted one is looked
        up over HTTP (the read-only local Store holds no salts)."""
        request = {"format_id": _format_id_bytes(format_id).hex(), "namespace": namespace,
                   "tokens": [int(t) for t in tokens], "max_tokens": max_tokens}
        # the local map's Store holds no salts: a salted namespace is looked up over HTTP
        if self._local is not None and self.chain_salt(namespace) is None:
            match = self._local.lookup_prefix(format_id, namespace, tokens, max_tokens=max_tokens)
            self._replay(request)
            return match
        body = self._post("/v1/prefix/lookup", request, idempotent=True)
        return PrefixMatch(body["tokens_matched"], tuple(self._block(b) for b in body["blocks"]))

    def _replay(self, request: dict) -> None:
        with self._pool_lock:
            if self._replays_pending >= MAX_PENDING_REPLAYS:
                return  # only LRU information is lost
            self._replays_pending += 1
            if self._replayer is None:
                self._replayer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-replay")
        self._replayer.submit(self._replay_one, request)

    def _replay_one(self, request: dict) -> None:
        try:
            self._post("/v1/prefix/lookup", request, idempotent=True)
        except Exception as exc:  # noqa: BLE001 - background: keep it for the caller
            self.last_replay_error = exc
        finally:
            with self._pool_lock:
                self._replays_pending -= 1

    # -- checkpoints -----------------------------------------------------------------------
    def create_checkpoint(self, checkpoint: Checkpoint, *, replace: bool = False) -> Checkpoint:
        payload = {**checkpoint_to_json(checkpoint, with_times=False), "replace": replace}
        return checkpoint_from_json(self._post("/v1/checkpoints", payload, idempotent=False))

    def get_checkpoint(self, namespace: str, name: str) -> Checkpoint:
        return checkpoint_from_json(self._get(f"/v1/checkpoints/{_segment(namespace)}/{_segment(name)}"))

    def list_checkpoints(self, namespace: str | None = None) -> list[Checkpoint]:
        params = {"namespace": namespace} if namespace is not None else {}
        body = self._get("/v1/checkpoints", params=params)
        return [checkpoint_from_json(c) for c in body["checkpoints"]]

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        self._send("DELETE", f"/v1/checkpoints/{_segment(namespace)}/{_segment(name)}",
                   idempotent=False)

    # -- capacity, stats, maintenance ------------------------------------------------------
    def evict(self, to_nbytes: int) -> EvictionReport:
        body = self._post("/v1/admin/evict", {"to_nbytes": int(to_nbytes)}, idempotent=False,
                          timeout=None)
        return EvictionReport(body["blocks"], body["pages"], body["freed_nbytes"])

    def stats(self) -> StoreStats:
        body = self._get("/v1/stats")
        return StoreStats(**{f.name: body[f.name] for f in fields(StoreStats)})

    def check(self, read_data: bool = False, subset: tuple[int, int] | None = None,
              progress=None) -> CheckReport:
        body = self._post("/v1/admin/check", {"read_data": read_data,
                                              "subset": list(subset) if subset else None},
                          idempotent=True, timeout=None)
        report = CheckReport(**{k: body[k] for k in ("pages_checked", "pages_read", "bytes_read",
                                                     "blocks_checked", "checkpoints_checked")})
        report.problems = [Problem(p["kind"], p["object"], p["detail"]) for p in body["problems"]]
        return report

    def plan_gc(self, grace_s: float = 3600.0) -> RemoteGCPlan:
        body = self._post("/v1/admin/gc", {"grace_s": float(grace_s), "dry_run": True},
                          idempotent=True, timeout=None)
        return RemoteGCPlan(self, float(grace_s), body["plan"])


class _Retry(Exception):
    """A transport failure of an idempotent read: reconnect and send it again."""


class _DirectReader:
    """Batch page reads over one kept-alive http.client connection per thread."""

    def __init__(self, url: str, headers: dict, timeout_s: float):
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https"):
            raise InvalidInput(f"RemoteStore needs an http(s) URL, not {url!r}")
        self._cls = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        self._host, self._port = parsed.host, parsed.port
        self._prefix = parsed.path.rstrip("/")
        self._headers = {**headers, "Content-Type": "application/json",
                         "Accept": PAGE_STREAM_MEDIA_TYPE}
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._all: list = []
        self._lock = threading.Lock()

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._cls(self._host, self._port, timeout=self._timeout_s)
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def _drop(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def read(self, body: dict, digests: list, buffers: Sequence) -> int:
        conn = self._connection()
        try:
            conn.request("POST", self._prefix + "/v1/pages/get", body=json.dumps(body).encode(),
                         headers=self._headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise _Retry() from exc
        try:
            if response.status >= 400:
                payload = response.read()
                if response.status in RETRY_STATUSES:
                    raise _Retry() from StoreIOError(f"HTTP {response.status}")
                raise _error_from(response.status, payload)
            media = response.getheader("content-type", "")
            if not media.startswith(PAGE_STREAM_MEDIA_TYPE):
                raise StoreIOError(f"expected a page stream, got {media!r}")
            total = read_stream_into(response.readinto, digests, buffers)
            if response.read(1):
                raise StoreIOError("the page stream has bytes past its end marker")
            return total
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            if isinstance(exc, StoreIOError):
                raise
            raise _Retry() from exc
        except BaseException:
            self._drop()  # a half-read response leaves the connection unusable
            raise

    def close(self):
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


# -- helpers -------------------------------------------------------------------------------
def _error(response: httpx.Response) -> KVStoreError:
    return _error_from(response.status_code, response.content)


def _error_from(status: int, payload: bytes) -> KVStoreError:
    try:
        body = json.loads(payload)
    except ValueError:
        body = {"message": payload[:200].decode(errors="replace")}
    if not isinstance(body, dict):
        body = {"message": str(body)[:200]}
    if status in (401, 403):
        exc = AccessDenied(str(body.get("message", "access denied")))
        exc.http_status = status
        return exc
    return error_from_body(body, status)


def _format_id_bytes(format_id) -> bytes:
    if isinstance(format_id, FormatIdentity):
        return format_id.format_id
    return bytes(ChainKey.coerce(format_id))


def _segment(value: str) -> str:
    """A namespace or name as one URL path segment; the server re-checks the pattern."""
    if not isinstance(value, str) or value in ("", ".", ".."):
        raise InvalidInput(f"bad name {value!r}")
    return quote(value, safe="")


def _read_batches(sizes: list[int], max_nbytes: int = READ_BATCH_NBYTES) -> Iterator[tuple[int, int]]:
    start, nbytes = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (nbytes + n > max_nbytes or i - start >= DIGESTS_PER_REQUEST):
            yield start, i
            start, nbytes = i, 0
        nbytes += n
    if start < len(sizes):
        yield start, len(sizes)


def _upload_body(data, compress: bool) -> tuple[bytes, dict]:
    raw = data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))
    headers = {"Content-Type": "application/octet-stream"}
    if compress and len(raw) >= 4096:
        sample = raw[:COMPRESS_SAMPLE_NBYTES]
        if len(zstandard.ZstdCompressor(level=1).compress(sample)) < 0.9 * len(sample):
            frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
            if len(frame) < 0.9 * len(raw):
                return frame, {**headers, "Content-Encoding": "zstd"}
    return raw, headers
