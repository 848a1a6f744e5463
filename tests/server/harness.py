"""The server subprocesses the tests drive: tools/bench/server_process.py."""

from tools.bench.server_process import (  # noqa: F401
    REPO,
    ServerProcess,
    kvstore_serve,
    serve_model,
    server_env,
    stock_server,
)
