"""The server subprocesses the tests drive: tools/bench/server_process.py."""

from tools.bench.server_process import (  # noqa: F401
    REPO,
    ServerProcess,
    kvstore_serve,
    serve_model,
    server_env,
    stock_server,
)

# A loaded CI machine must not turn a hit into a miss: the tests that assert hits wait this long.
PATIENT = ("--lookup-timeout", "30s")
