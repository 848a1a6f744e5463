"""KVPolicy: which page format a model's KV cache uses.

The format is chosen per model: a default for every model, and overrides keyed by the
exact model id (no globs, no prefixes: "org/model-4bit" is a different model from
"org/model"). Native, the model's own dtype, is the default. Weight quantization never
selects KV precision: nothing here looks at a model's weights or its quantization
config, only at its id.

TOML form (tomllib, no extra dependency; KVPolicy.from_toml(text), KVPolicy.load(path)):

    default = "native"            # or k8v8, k8v4, k4v4, native-bf16, ...
    block_size_tokens = 128
    group_size = 64
    rotation = "auto"             # auto: rotate packed keys when head_dim is a power of 2
    rotation_seed = 0
    [overrides]
    "mlx-community/Qwen3-0.6B-bf16" = "k8v4"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from engine.errors import InvalidPolicy
from engine.formats import FORMAT_ALIASES, FORMATS

ROTATION_MODES = ("auto", "on", "off")
DEFAULT_BLOCK_SIZE_TOKENS = 128
DEFAULT_GROUP_SIZE = 64
DEFAULT_ROTATION_SEED = 0


def _check_format_name(name) -> str:
    if not isinstance(name, str) or (name not in FORMATS and name not in FORMAT_ALIASES):
        known = ", ".join(sorted(set(FORMATS) | set(FORMAT_ALIASES)))
        raise InvalidPolicy(f"unknown page format {name!r} (known: {known})")
    return name


@dataclass(frozen=True)
class KVPolicy:
    default_format: str = "native"
    overrides: tuple[tuple[str, str], ...] = field(default=())  # (model id, format), sorted
    block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS
    group_size: int = DEFAULT_GROUP_SIZE
    rotation: str = "auto"  # "auto" | "on" | "off": key rotation for packed formats
    rotation_seed: int = DEFAULT_ROTATION_SEED

    def __post_init__(self):
        _check_format_name(self.default_format)
        pairs = self.overrides.items() if isinstance(self.overrides, Mapping) else self.overrides
        checked = []
        for model_id, name in pairs:
            if not isinstance(model_id, str) or not model_id:
                raise InvalidPolicy(f"override keys are model ids, got {model_id!r}")
            checked.append((model_id, _check_format_name(name)))
        object.__setattr__(self, "overrides", tuple(sorted(checked)))
        for name in ("block_size_tokens", "group_size", "rotation_seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidPolicy(f"{name} must be a non-negative integer, got {value!r}")
        if not 1 <= self.block_size_tokens <= 65536:
            raise InvalidPolicy("block_size_tokens must be in [1, 65536]")
        if self.group_size == 0:
            raise InvalidPolicy("group_size must be positive")
        if self.rotation not in ROTATION_MODES:
            raise InvalidPolicy(f"rotation must be one of {ROTATION_MODES}, got {self.rotation!r}")

    def format_for(self, key: str | None) -> str:
        """The page format name (an alias such as "native") for this exact model id: its
        override, else the default."""
        for model, name in self.overrides:
            if model == key:
                return name
        return self.default_format

    def with_format(self, name: str) -> "KVPolicy":
        """The same policy with another default and no overrides (benchmarks, tests)."""
        return replace(self, default_format=name, overrides=())

    # -- parsing ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping) -> "KVPolicy":
        if not isinstance(data, Mapping):
            raise InvalidPolicy("a KV policy is a table of settings")
        known = {"default", "overrides", "block_size_tokens", "group_size", "rotation",
                 "rotation_seed"}
        unknown = set(data) - known
        if unknown:
            raise InvalidPolicy(f"unknown KV policy keys: {sorted(unknown)}")
        overrides = data.get("overrides", {})
        if not isinstance(overrides, Mapping):
            raise InvalidPolicy("overrides must be a table of model id = format")
        kwargs = {k: data[k] for k in ("block_size_tokens", "group_size", "rotation",
                                       "rotation_seed") if k in data}
        return cls(default_format=data.get("default", "native"), overrides=dict(overrides),
                   **kwargs)

    @classmethod
    def from_toml(cls, text: str) -> "KVPolicy":
        """A policy from TOML text (see the module docstring)."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidPolicy(f"KV policy is not valid TOML: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> "KVPolicy":
        """A policy from a TOML file."""
        return cls.from_toml(Path(path).read_text())
