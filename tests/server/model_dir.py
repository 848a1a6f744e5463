"""The fixture model directory: tools/bench/model_dir.py at its (tiny) default sizes."""

from tools.bench.model_dir import SPECIALS, build_model_dir, text  # noqa: F401
