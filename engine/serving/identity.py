"""ModelFingerprint: which weights and which tokenizer a server's pages belong to.

The format identity (kvstore.format) already fingerprints the model's config; two
checkpoints of one architecture (a fine-tune, another seed) share that config, so the
model id carries a digest of the weight files' bytes, and the tokenizer fingerprint a
digest of the tokenizer files. Both are blake3 over (file name, size, bytes) of the
files in sorted order, read through mmap with blake3's threads.

Cost: the weights are read once at start-up (the OS page cache usually has them, since
mlx-lm loads the same files); about a second per few GB on a laptop SSD.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import blake3

WEIGHT_PATTERNS = ("*.safetensors",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
TOKENIZER_PATTERNS = ("*.tiktoken",)
DIGEST_HEX_CHARS = 32  # 128 bits of blake3 in ids and namespaces
_NAMESPACE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ModelFingerprint:
    name: str                   # e.g. "mlx-community/Qwen3-0.6B-bf16" or a directory name
    weights_digest: str         # blake3 hex of the weight (and adapter) files
    tokenizer_fingerprint: str  # blake3 hex of the tokenizer files

    @property
    def model_id(self) -> str:
        """The format identity's model_id: name @ weights digest (<= 256 characters)."""
        return f"{self.name[:200]}@{self.weights_digest[:DIGEST_HEX_CHARS]}"

    @property
    def default_namespace(self) -> str:
        return default_namespace(self.name)


def default_namespace(name: str) -> str:
    """A store namespace named after the model (1-64 of [A-Za-z0-9_.-])."""
    cleaned = _NAMESPACE_BAD.sub("-", name).strip(".-") or "model"
    return cleaned[-64:].lstrip(".-") or "model"


def _digest_files(paths: list[Path]) -> str:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for path in sorted(paths, key=lambda p: p.name):
        name = path.name.encode()
        hasher.update(len(name).to_bytes(2, "little") + name)
        hasher.update(path.stat().st_size.to_bytes(8, "little"))
        hasher.update_mmap(path)
    return hasher.hexdigest()


def _files(directory: Path, names: tuple[str, ...], patterns: tuple[str, ...]) -> list[Path]:
    found = {p for n in names if (p := directory / n).is_file()}
    for pattern in patterns:
        found.update(p for p in directory.glob(pattern) if p.is_file())
    return sorted(found)


def fingerprint_model(model_dir: str | Path, *, name: str | None = None,
                      adapter_dir: str | Path | None = None) -> ModelFingerprint:
    """Fingerprint a local model directory (and an adapter directory, if any).

    FileNotFoundError when the directory has no weight files: a directory mlx-lm
    cannot load either."""
    model_dir = Path(model_dir)
    weights = _files(model_dir, (), WEIGHT_PATTERNS)
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    if adapter_dir is not None:
        weights += _files(Path(adapter_dir), (), WEIGHT_PATTERNS)
    tokenizer = _files(model_dir, TOKENIZER_FILES, TOKENIZER_PATTERNS)
    if not tokenizer:
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) "
                                f"in {model_dir}")
    return ModelFingerprint(name or model_dir.resolve().name, _digest_files(weights),
                            _digest_files(tokenizer))
