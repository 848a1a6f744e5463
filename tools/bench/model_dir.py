"""A real mlx-lm model directory, built offline: what `mlx_lm.load` reads from a download.

Used by the serve-model tests (tests/server, tiny sizes) and the server benchmark
(tools/bench/server.py, CPU-scaled sizes).

build_model_dir(path) writes
  config.json, model.safetensors(.index.json)   a tiny random-weight llama (or, with
                                                model_type="gemma3_text", a gemma3-style
                                                model whose sliding layers keep a
                                                RotatingKVCache), saved with mlx-lm's
                                                own save_model / save_config
  tokenizer.json                                a byte-level BPE trained with the
                                                `tokenizers` library on a synthetic corpus
  tokenizer_config.json                         PreTrainedTokenizerFast, bos/eos/unk/pad
                                                and a ChatML-like chat template

The q/k projections are scaled (x16 by default; gemma3 RMS-normalises q and k, so
there the norms' weights carry the scale): with unscaled random weights the
attention is nearly uniform and greedy decoding collapses into one repeated token, so
"same text as stock" would prove nothing. The special tokens' (tied) embedding rows are
zero, so their logit is 0 while the best token's is positive: greedy decoding never
stops early at <|im_end|> and every answer runs to max_tokens. Sizes are tiny on
purpose (2 CPU cores).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ("the a cache page store block token prefix model server request answer system user "
         "assistant restore publish layer key value head batch prompt compute memory disk "
         "shared stream reply hello world quick brown fox jumps over lazy dog one two three "
         "four five six seven eight nine ten red green blue alpha beta gamma delta").split()


def corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Synthetic text: random sentences over a small word list (deterministic)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + "."
            for _ in range(n_lines)]


def text(n_words: int, seed: int) -> str:
    """A deterministic passage of n_words words for prompts."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def write_tokenizer(path: Path, vocab_size: int = 384, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>",
        "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 32768, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


GEMMA3_SLIDING_WINDOW = 64  # tokens a sliding layer keeps: the fixture prompts rotate it


def _model_config(model_type: str, vocab_size: int, hidden_size: int, num_layers: int,
                  num_heads: int, num_kv_heads: int, head_dim: int | None,
                  intermediate_size: int | None) -> dict:
    common = {
        "model_type": model_type, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads, "vocab_size": vocab_size,
        "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 5,
    }
    if model_type == "llama":
        return {**common, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    if model_type == "gemma3_text":
        # every other layer slides (layers 0, 2, ...: RotatingKVCache), the rest are full
        # attention (KVCache); q and k are RMS-normed, so sharpness comes from the scale
        return {**common, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0, "sliding_window": GEMMA3_SLIDING_WINDOW,
                "sliding_window_pattern": 2, "query_pre_attn_scalar": common["head_dim"]}
    raise ValueError(f"model_type must be llama or gemma3_text, got {model_type!r}")


def write_model(path: Path, vocab_size: int, *, seed: int = 0, qk_scale: float = 16.0,
                model_type: str = "llama", hidden_size: int = 64, num_layers: int = 2,
                num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                intermediate_size: int | None = None, dtype: str = "float16",
                lazy: bool = False) -> None:
    """lazy: no evaluation of the whole model before saving; save_model (donating the
    model's arrays) then computes and writes one shard (<= 5 GB) at a time, so peak memory
    is a shard, not the model in float32 plus its cast (for the 8B-shaped bench model:
    about 5 GB instead of 42 GB, on whatever device MLX defaults to, the GPU there)."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    config = _model_config(model_type, vocab_size, hidden_size, num_layers, num_heads,
                           num_kv_heads, head_dim, intermediate_size)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    for layer in model.layers:
        attn = layer.self_attn
        if model_type == "llama":
            attn.q_proj.weight = attn.q_proj.weight * qk_scale
            attn.k_proj.weight = attn.k_proj.weight * qk_scale
        else:  # gemma's RMSNorm scales by (1 + weight): sqrt(qk_scale) on each of q and k
            attn.q_norm.weight = mx.full(attn.q_norm.weight.shape, qk_scale ** 0.5 - 1)
            attn.k_norm.weight = mx.full(attn.k_norm.weight.shape, qk_scale ** 0.5 - 1)
    silent = mx.arange(vocab_size) < len(SPECIALS)  # BpeTrainer puts specials first: ids 0..5
    embed = model.model.embed_tokens
    embed.weight = mx.where(silent[:, None], 0.0, embed.weight)
    model.set_dtype(getattr(mx, dtype))  # dtype of the weights on disk, as a real checkpoint
    if not lazy:
        mx.eval(model.parameters())
    save_model(path, model, donate_model=lazy)
    save_config({**config, "torch_dtype": dtype}, path / "config.json")


def build_model_dir(path: str | Path, *, seed: int = 0, tokenizer_seed: int = 0,
                    vocab_size: int = 384, **model_sizes) -> Path:
    """Write a loadable model directory at `path` (see the module docstring);
    model_sizes go to write_model (hidden_size, num_layers, num_heads, ...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, vocab_size, seed=tokenizer_seed)
    n_vocab = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    write_model(path, max(n_vocab, vocab_size), seed=seed, **model_sizes)
    return path
