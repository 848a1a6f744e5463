# Sourced by the device drivers (bash): mlx-lm imports transformers at load, and the device
# machine has none. Where it is absent, a stand-in with the names mlx-lm imports goes first
# on PYTHONPATH (no tokenizer works through it: the benchmarks build models from configs).
if ! python3 -c "import transformers" 2>/dev/null; then
  mkdir -p /root/stub/transformers
  cat > /root/stub/transformers/__init__.py <<'PY'
"""Stand-in for transformers: the names mlx-lm imports at load; no tokenizer works."""
class PreTrainedTokenizer: pass
class PreTrainedTokenizerFast(PreTrainedTokenizer): pass
class AutoTokenizer:
    register = classmethod(lambda cls, *a, **k: None)
    @classmethod
    def from_pretrained(cls, *a, **k): raise RuntimeError("transformers stand-in: no tokenizers")
class AutoConfig(AutoTokenizer): pass
PY
  echo "class PreTrainedTokenizerBase: pass" > /root/stub/transformers/tokenization_utils_base.py
  export PYTHONPATH=/root/stub:${PYTHONPATH:-}
  echo "transformers: stand-in"
fi
