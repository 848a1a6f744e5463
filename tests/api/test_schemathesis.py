"""schemathesis against /openapi.json of a real server: 0 server errors.

Bounded by KVSTORE_SCHEMATHESIS_S seconds (default 90). schemathesis is a requested
dev dependency; without it this test skips and says so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import ADMIN

SCHEMATHESIS = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")


@pytest.mark.slow
def test_no_server_errors_on_generated_requests(live_server):
    if not Path(SCHEMATHESIS).exists():
        pytest.skip("SKIPPED LOUDLY: schemathesis is not installed; `pip install schemathesis` "
                    "(requested dev dependency) to run the OpenAPI fuzz test")
    budget_s = int(os.environ.get("KVSTORE_SCHEMATHESIS_S", "90"))
    done = subprocess.run(
        [SCHEMATHESIS, "run", f"{live_server.url}/openapi.json",
         "-H", f"Authorization: Bearer {ADMIN}", "--checks", "not_a_server_error",
         "--max-time", str(budget_s), "--workers", "1", "--seed", "1"],
        capture_output=True, text=True, timeout=budget_s + 120, cwd=live_server.data_dir.parent)
    summary = done.stdout[-4000:]
    found = re.search(r"(\d+) generated, (.*)", summary)
    assert found, summary
    print(f"METRIC schemathesis_cases={found.group(1)} result={found.group(2)!r}")
    assert done.returncode == 0, summary
    assert live_server.alive()
    assert "Exception in ASGI" not in live_server.read_log(), live_server.read_log()[-3000:]
