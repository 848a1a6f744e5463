"""The dashboard in a real headless Chromium against a real service with a token set.

The service is api.create_app over a temporary store, wrapped by
tools.dashboard.with_dashboard, under uvicorn on a free loopback port. Chromium is
Debian's `chromium`; when absent it is installed with apt-get, and when that fails the
browser tests skip with a loud reason. A screenshot is kept in test-artifacts/."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvstore.store import Store
from tests.tools.helpers import ADMIN_TOKEN, USER_TOKEN, build_store, live_service

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
TOKEN = ADMIN_TOKEN
BUDGET_S = "8000"  # virtual ms Chromium lets the page's fetches and timers run


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from tools.dashboard import with_dashboard

    path = tmp_path_factory.mktemp("dash") / "store"
    build_store(path)
    with live_service(path, wrap=with_dashboard, token=USER_TOKEN, admin_token=TOKEN) as url:
        yield url


def test_shell_is_public_and_data_need_the_token(service):
    page = httpx.get(service + "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert TOKEN not in page.text
    assert httpx.get(service + "/dashboard/dashboard.js").status_code == 200
    assert httpx.get(service + "/v1/stats").status_code == 401
    assert httpx.get(service + "/v1/checkpoints").status_code == 401
    assert httpx.get(service + "/dashboard/../v1/stats").status_code == 401
    assert httpx.get(service + "/dashboard/secret.txt").status_code == 401  # not a shell file
    authed = httpx.get(service + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    assert authed.status_code == 200 and authed.json()["checkpoint_count"] == 3


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    install = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "chromium"],
                             capture_output=True, text=True, timeout=600,
                             env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    found = shutil.which("chromium")
    if not found:
        reason = ("SKIPPED LOUDLY: Debian's chromium is absent and `apt-get install chromium` failed "
                  f"(exit {install.returncode}): {install.stderr[-300:]}")
        warnings.warn(reason, stacklevel=2)
        pytest.skip(reason)
    return found


def browse(url: str, *extra: str) -> str:
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--hide-scrollbars", f"--virtual-time-budget={BUDGET_S}",
            "--window-size=1280,900", *extra, url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rows(dom: str) -> list[str]:
    return re.findall(r'<tr data-name="([^"]+)"', dom)


def test_page_shows_checkpoints_and_search_filters(service):
    dom = browse(f"{service}/#token={TOKEN}", "--dump-dom")
    assert rows(dom) == ["default/native", "default/system-prompt", "team-a/short"], dom[-3000:]
    assert "3 of 3 shown" in dom
    assert re.search(r'id="dedup">\d+\.\d\d×<', dom), "dedup ratio not rendered"
    assert "native-bf16+k8v4" in dom and "test/tiny" in dom
    assert "<polyline" in dom, "usage chart has no line"
    filtered = browse(f"{service}/?q=system#token={TOKEN}", "--dump-dom")
    assert rows(filtered) == ["default/system-prompt"]
    assert "1 of 3 shown" in filtered
    by_namespace = browse(f"{service}/?q=team-a%20k8v4#token={TOKEN}", "--dump-dom")
    assert rows(by_namespace) == ["team-a/short"]
    user = browse(f"{service}/#token={USER_TOKEN}", "--dump-dom")
    assert rows(user) == ["default/native", "default/system-prompt"], "a user token saw another namespace"


def test_page_without_token_asks_for_one(service):
    dom = browse(f"{service}/", "--dump-dom")
    assert rows(dom) == []
    assert '<form id="token-form">' in dom, "the token form did not come up"
    assert "a token is required" in dom
    wrong = browse(f"{service}/#token=not-the-token-at-all", "--dump-dom")
    assert rows(wrong) == [] and "the token was refused" in wrong


class DevTools:
    """One page of a headless Chromium, driven over the DevTools protocol (websockets,
    already a dependency through uvicorn[standard]): enough to type and read back."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    def send(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def eval(self, expression: str):
        return self.send("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while not self.eval(expression):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)


@contextmanager
def devtools(url: str, profile: Path):
    from websockets.sync.client import connect

    proc = subprocess.Popen(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--hide-scrollbars", "--window-size=1280,900",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port, deadline = None, time.monotonic() + 60
        while port is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no DevTools port"
            match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", proc.stderr.readline())
            port = match and int(match.group(1))
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        with connect(page["webSocketDebuggerUrl"], max_size=None) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        proc.wait(30)


ROWS_JS = "[...document.querySelectorAll('#checkpoints tbody tr')].map(r => r.dataset.name)"


def test_typing_in_search_filters_the_table(service, tmp_path):
    """Real keystrokes (Input.insertText) into the search box; the screenshot kept in
    test-artifacts/ shows the filtered page."""
    pytest.importorskip("websockets")
    with devtools(f"{service}/#token={TOKEN}", tmp_path / "profile") as browser:
        browser.wait_for(f"{ROWS_JS}.length === 3")
        browser.eval("document.querySelector('#search').focus()")
        browser.send("Input.insertText", text="system")
        assert browser.eval(ROWS_JS) == ["default/system-prompt"]
        assert browser.eval("document.querySelector('#shown').textContent") == "1 of 3 shown"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = browser.send("Page.captureScreenshot", format="png")["data"]
        (ARTIFACTS / "dashboard-search.png").write_bytes(base64.b64decode(shot))
        browser.eval("document.querySelector('#search').select()")
        browser.send("Input.insertText", text="k8v4 team")
        assert browser.eval(ROWS_JS) == ["team-a/short"]
        browser.eval("document.querySelector('#search').select()")
        browser.send("Input.insertText", text="no-such-thing")
        assert browser.eval(ROWS_JS) == []


def test_screenshot_is_kept(service):
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    browse(f"{service}/#token={TOKEN}", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_api_router_serves_the_same_shell(tmp_path):
    """api/routes/dashboard.py: the in-API way to serve the shell (once it is in ROUTERS
    and its paths are public); here mounted by hand on an app without tokens."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.routes import dashboard
    from tools.dashboard import SHELL, STATIC_DIR

    assert dashboard.SHELL_PATHS == set(SHELL) and dashboard.STATIC_DIR == STATIC_DIR
    build_store(tmp_path / "store")
    with Store(tmp_path / "store") as store:
        app = create_app(store=store)
        app.include_router(dashboard.router)
        with TestClient(app) as client:
            for path, (name, media_type) in SHELL.items():
                response = client.get(path)
                assert response.status_code == 200 and response.headers["content-type"] == media_type
                assert response.content == (STATIC_DIR / name).read_bytes()
            assert client.get("/dashboard/index.html").status_code == 404
