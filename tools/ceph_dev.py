"""A throwaway single-node Ceph cluster with a RADOS Gateway on 127.0.0.1, for tests
and benchmarks of the S3 page tier (kvstore/tier). Not for production.

    with CephCluster.start() as cluster:          # installs the packages when missing
        cluster.endpoint, cluster.access_key, cluster.secret_key
        cluster.stop_rgw(); cluster.start_rgw()   # kill and restart the gateway

    python -m tools.ceph_dev up     # start one, print its endpoint and keys; ^C or
                                    # SIGTERM stops every daemon

Shape: one monitor, one BlueStore OSD on a sparse file, one radosgw (beast frontend),
no manager (pools get a fixed PG count, nothing needs the autoscaler). Replicas are 1.
All state (config, keyrings, mon store, OSD block file, logs, admin sockets) lives in
one temporary directory. Every daemon runs in the foreground as our child process and
is stopped by its pid in stop(): nothing is left running, nothing outside the
directory is touched. The packages (ceph-mon, ceph-osd, radosgw, ceph-common) come
from Debian through apt-get when a binary is missing; PackagesUnavailable says why
when that fails, so the tests can skip loudly.

Facts this setup relies on, measured for Ceph 16.2 on Debian bookworm (issue 11):
  - one OSD needs `osd pool default size = 1`, `min size = 1`, `osd crush chooseleaf
    type = 0` and `mon allow pool size one = true`;
  - BlueStore on a sparse file needs `bluestore block create` and `bluestore block
    size`, with the block path outside the OSD data directory (inside, it ends up a
    symlink to itself);
  - the mon gets its own keyring under [mon] keyring = $mon_data/keyring;
  - beast needs tcp_nodelay=1, or small GETs stall about 47 ms each;
  - radosgw spends about 10 s creating its pools on first start: wait for HTTP.
Cost: about 0.8 GB of RAM; ~45 s from clean including the install, ~20 s after.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("ceph-mon", "ceph-osd", "radosgw", "ceph-common")
BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph", "ceph-authtool", "monmaptool")
OSD_BLOCK_NBYTES = 8 << 30  # sparse; only what is written takes disk
START_TIMEOUT_S = 120.0


class PackagesUnavailable(RuntimeError):
    """The Ceph packages are missing and could not be installed (no apt, no network)."""


class ClusterFailed(RuntimeError):
    """A daemon did not come up; the message names it and ends with its log tail."""


def ensure_packages(log=print) -> None:
    """Install the Debian packages when a binary is missing; PackagesUnavailable if that fails."""
    if all(shutil.which(b) for b in BINARIES):
        return
    if shutil.which("apt-get") is None:
        raise PackagesUnavailable("ceph binaries missing and there is no apt-get on this machine")
    if os.geteuid() != 0:
        raise PackagesUnavailable("ceph binaries missing and installing them needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log(f"installing {' '.join(PACKAGES)} from Debian (about 40 s)")
    for argv in (["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
                 ["apt-get", "update"],
                 ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode == 0 and all(shutil.which(b) for b in BINARIES):
            return
    raise PackagesUnavailable(f"apt-get could not install {PACKAGES}: {done.stderr.strip()[-600:]}")


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent goes (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {dir}/admin.keyring
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
log file = {dir}/log/$name.log
pid file = {dir}/run/$name.pid
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
mon max pg per osd = 1000
mon pg warn min per osd = 0
osd objectstore = bluestore
osd memory target = 939524096
bluestore cache autotune = false
bluestore cache size = 134217728
bluefs buffered io = true
osd op num shards = 1
osd op num threads per shard = 2
rgw thread pool size = 64

[mon]
mon data = {dir}/mon/$cluster-$id
keyring = $mon_data/keyring

[osd]
osd data = {dir}/osd/$cluster-$id
keyring = $osd_data/keyring
bluestore block path = {dir}/osd-block-$id
bluestore block create = true
bluestore block size = {block_nbytes}

[client.rgw.a]
keyring = {dir}/rgw.keyring
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {dir}/rgw
rgw dns name = 127.0.0.1
"""


@dataclass
class CephCluster:
    """One running cluster; see the module docstring. Build it with CephCluster.start()."""

    dir: Path
    rgw_port: int
    mon_port: int
    access_key: str = field(default_factory=lambda: "KV" + secrets.token_hex(9).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    procs: dict = field(default_factory=dict)  # name -> Popen
    owns_dir: bool = True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    @property
    def conf(self) -> str:
        return str(self.dir / "ceph.conf")

    # -- lifecycle -----------------------------------------------------------------------
    @classmethod
    def start(cls, base_dir: str | None = None, log=print) -> "CephCluster":
        ensure_packages(log)
        cluster = cls(Path(tempfile.mkdtemp(prefix="kvstore-ceph-", dir=base_dir)),
                      free_port(), free_port())
        try:
            cluster._bootstrap(log)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        """Stop every daemon by pid (SIGTERM, then SIGKILL after 10 s) and remove the dir."""
        for name in list(self.procs)[::-1]:
            self._stop(name)
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _stop(self, name: str, sig=signal.SIGTERM) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop_rgw(self, sig=signal.SIGKILL) -> None:
        """Kill the gateway (SIGKILL by default: an outage, not a clean shutdown)."""
        self._stop("rgw", sig)

    def start_rgw(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self._spawn("rgw", ["radosgw", "-f", "-n", "client.rgw.a", "-c", self.conf])
        self._wait(lambda: self._http_up(), "radosgw answering HTTP", timeout_s, "rgw")

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items() if p.poll() is None}

    # -- bootstrap -----------------------------------------------------------------------
    def _bootstrap(self, log) -> None:
        t0 = time.monotonic()
        d = self.dir
        for sub in ("run", "log", "mon", "osd", "rgw"):
            (d / sub).mkdir()
        fsid = str(uuid.uuid4())
        (d / "ceph.conf").write_text(CONF.format(fsid=fsid, mon_port=self.mon_port, dir=d,
                                                 rgw_port=self.rgw_port,
                                                 block_nbytes=OSD_BLOCK_NBYTES))
        # keyrings: mon., client.admin (imported into the mon's), client.rgw.a later
        self._run("ceph-authtool", "--create-keyring", d / "mon.keyring", "--gen-key", "-n", "mon.",
                  "--cap", "mon", "allow *")
        self._run("ceph-authtool", "--create-keyring", d / "admin.keyring", "--gen-key", "-n",
                  "client.admin", "--cap", "mon", "allow *", "--cap", "osd", "allow *",
                  "--cap", "mgr", "allow *")
        self._run("ceph-authtool", d / "mon.keyring", "--import-keyring", d / "admin.keyring")
        self._run("monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{self.mon_port}]",
                  "--fsid", fsid, d / "monmap")
        self._run("ceph-mon", "-c", self.conf, "--mkfs", "-i", "a", "--monmap", d / "monmap",
                  "--keyring", d / "mon.keyring")
        self._spawn("mon", ["ceph-mon", "-f", "-c", self.conf, "-i", "a"])
        self._wait(lambda: self._ceph_ok("mon", "stat"), "the monitor", 60, "mon")
        log(f"ceph: mon up after {time.monotonic() - t0:.1f}s")

        osd_uuid = str(uuid.uuid4())
        secret = self._run("ceph-authtool", "--gen-print-key").strip()
        osd_id = self._ceph("osd", "new", osd_uuid, "-i", "-",
                            stdin=json.dumps({"cephx_secret": secret})).strip()
        osd_dir = d / "osd" / f"ceph-{osd_id}"
        osd_dir.mkdir()
        self._run("ceph-authtool", "--create-keyring", osd_dir / "keyring", "--name",
                  f"osd.{osd_id}", "--add-key", secret)
        self._run("ceph-osd", "-c", self.conf, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._spawn("osd", ["ceph-osd", "-f", "-c", self.conf, "-i", osd_id])
        self._wait(lambda: '"num_up_osds":1' in self._ceph("osd", "stat", "-f", "json").replace(" ", ""),
                   "the OSD", 90, "osd")
        log(f"ceph: osd up after {time.monotonic() - t0:.1f}s")

        self._ceph("auth", "get-or-create", "client.rgw.a", "mon", "allow rw", "osd", "allow rwx",
                   "-o", str(d / "rgw.keyring"))
        self.start_rgw()
        log(f"ceph: rgw answering after {time.monotonic() - t0:.1f}s")
        self._run("radosgw-admin", "-c", self.conf, "user", "create", "--uid", "kvstore",
                  "--display-name", "kvstore tests", "--access-key", self.access_key,
                  "--secret-key", self.secret_key)
        log(f"ceph: cluster ready at {self.endpoint} in {time.monotonic() - t0:.1f}s ({d})")

    def _run(self, *argv, stdin: str | None = None, timeout: float = 60) -> str:
        argv = [str(a) for a in argv]
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise ClusterFailed(f"{' '.join(argv[:4])} failed ({done.returncode}): "
                                f"{(done.stderr or done.stdout).strip()[-800:]}")
        return done.stdout

    def _ceph(self, *args, stdin: str | None = None) -> str:
        return self._run("ceph", "-c", self.conf, "--connect-timeout", "10", *args, stdin=stdin)

    def _ceph_ok(self, *args) -> bool:
        try:
            self._ceph(*args)
            return True
        except (ClusterFailed, subprocess.TimeoutExpired):
            return False

    def _spawn(self, name: str, argv: list) -> None:
        log_file = open(self.dir / "log" / f"{name}.stdout", "ab")
        # own process group: a ^C in the test runner does not hit the daemons first;
        # parent-death signal: a runner killed outright (SIGKILL, a CI timeout) takes
        # its daemons with it. (It fires when the spawning *thread* exits: spawn from a
        # long-lived thread, as the tests and tools do from the main one.)
        self.procs[name] = subprocess.Popen([str(a) for a in argv], stdout=log_file,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        log_file.close()

    def _http_up(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint, timeout=2) as r:
                return r.status < 500
        except urllib.error.HTTPError as exc:
            return exc.code < 500
        except OSError:
            return False

    def _wait(self, ready, what: str, timeout_s: float, name: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ClusterFailed(f"{what} exited with {proc.returncode}: {self._log_tail(name)}")
            if ready():
                return
            time.sleep(0.25)
        raise ClusterFailed(f"{what} not ready after {timeout_s:.0f}s: {self._log_tail(name)}")

    def _log_tail(self, name: str) -> str:
        out = []
        for path in sorted((self.dir / "log").glob("*")):
            if name in path.name or (name == "rgw" and "rgw" in path.name):
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-1500:])
        return "\n".join(out) or "(no log)"


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["up"]:
        print("usage: python -m tools.ceph_dev up   (starts a cluster, prints its endpoint, ^C stops it)")
        return 2
    def interrupted(signum, frame):
        raise KeyboardInterrupt
    # a background job starts with SIGINT ignored: catch both, so stop() always runs
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    with CephCluster.start() as cluster:
        print(json.dumps({"endpoint": cluster.endpoint, "access_key": cluster.access_key,
                          "secret_key": cluster.secret_key, "dir": str(cluster.dir),
                          "pids": cluster.pids()}), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
