"""`kvstore bench` is a thin runner: one process per suite, its stdout in OUT/<suite>.md.

The suites themselves are exercised by the benchmarks issue's smoke test; here two
stand-in suites (one succeeds, one fails) check the runner's contract without spending
minutes of CPU on real benchmarks."""

from __future__ import annotations

import textwrap

from tests.tools.helpers import run
from tools.commands import bench
from tools.commands.common import EXIT_OK, EXIT_PROBLEMS

GOOD = '''
import sys
def main(argv):
    print("| suite | argv |")
    print("|---|---|")
    print(f"| good | {' '.join(argv)} |")
    return 0
if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
'''
BAD = '''
import sys
print("| partial |")
sys.stderr.write("boom: out of sorts\\n")
raise SystemExit(3)
'''


def test_bench_runs_each_suite_and_writes_its_markdown(tmp_path, monkeypatch):
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "store.py").write_text(textwrap.dedent(GOOD))
    (package / "ttft.py").write_text(textwrap.dedent(GOOD))
    (package / "http.py").write_text(textwrap.dedent(BAD))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(bench, "SUITE_PACKAGE", "fakebench")
    out = tmp_path / "results"
    ran = run("bench", "--quick", "--suite", "store", "--suite", "ttft", "--out", out, "--json")
    assert ran.code == EXIT_OK, ran.stderr
    doc = ran.json()
    assert [s["suite"] for s in doc["suites"]] == ["store", "ttft"] and doc["ok"]
    assert (out / "store.md").read_text().splitlines()[2] == "| good | --quick |"
    assert (out / "ttft.md").exists()
    failed = run("bench", "--suite", "http", "--suite", "store", "--out", out, "--json")
    assert failed.code == EXIT_PROBLEMS
    http, store = failed.json()["suites"]
    assert not http["ok"] and http["returncode"] == 3 and "boom" in http["stderr_tail"]
    assert (out / "http.md").read_text() == "| partial |\n"
    assert "boom" in (out / "http.stderr.txt").read_text()
    assert store["ok"] and (out / "store.md").read_text().splitlines()[2] == "| good |  |"
