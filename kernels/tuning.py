"""DirectTuning: the launch parameters of the direct (CUDA, Metal) kernels, one frozen value.

The planner (kernels/direct.py) takes it as an argument; nothing in kernels/ keeps tuning in
module state. environment_tuning() is the one place that reads the environment overrides
the profiling harness and device test runs use:
  KVSTORE_DIRECT_TUNING    "unroll,warps,target_blocks[,dims_per_lane[,mma_warps,
                           mma_target_blocks[,mma_pipe[,mma_stages[,mma_sub[,mma_raw[,
                           mma_early_issue]]]]]]]" (DirectTuning.parse; the fields after
                           mma_early_issue are set by DirectTuning(...) only)
  KVSTORE_DIRECT_MMA       "0": packed pages use the lane-group kernel too
  KVSTORE_DIRECT_MMA_RAW   "0": the tensor-core kernel dequantizes every pair before the mma
  KVSTORE_DIRECT_NATIVE_MMA  "1" / "0": native fp16/bf16 pages take the tensor-core kernel for
                           16-bit pages on CUDA / the lane-group kernel (unset: the default,
                           the tensor-core kernel)
The defaults come from the H200 sweeps in docs/kernels.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache

TUNING_ENV = "KVSTORE_DIRECT_TUNING"
MMA_ENV = "KVSTORE_DIRECT_MMA"
MMA_RAW_ENV = "KVSTORE_DIRECT_MMA_RAW"
NATIVE_MMA_ENV = "KVSTORE_DIRECT_NATIVE_MMA"


@dataclass(frozen=True)
class DirectTuning:
    """Launch parameters of the lane-group kernel (kernels/cuda.py, kernels/metal.py) and of
    the tensor-core kernel (kernels/cuda_mma.py)."""

    unroll: int = 2  # tokens a lane group loads per step (halved for float32 pages: registers)
    num_warps: int = 4
    target_blocks: int = 132 * 2  # two blocks per SM of an H200 (132 SMs)
    dims_per_lane: int = 16  # head_dim values per lane; a lane group is D / dims_per_lane lanes
    mma_warps: int = 6  # warps per tensor-core block: the kernel is latency-bound
    mma_target_blocks: int = 132 * 2
    mma_pipe: bool | None = None  # prefetch the next step's page words; None: where registers allow
    mma_stages: int | None = None  # cp.async ring depth; None: as many as fit (up to 4), 0: off
    mma_sub: int | None = None  # 16-token steps per warp iteration; None: see direct._build_mma_plan
    mma_raw: bool = True  # codes into the mma as they are, scales per quantization group outside it
    # queries in their own shared memory where it fits, so the rings' first copies are issued
    # before the query prologue (False overlays them, for comparison)
    mma_early_issue: bool = True
    # > 0: compile the tensor-core kernel with __launch_bounds__(mma_warps * 32, mma_min_blocks),
    # so ptxas keeps registers low enough for that many blocks per SM (spilling if it must)
    mma_min_blocks: int = 0
    mma: bool = True  # packed pages with fp16/bf16 queries take the tensor-core kernel
    # native (unrotated fp16/bf16) pages on CUDA: the tensor-core kernel for 16-bit pages
    # (cuda_mma_native_split.cu) instead of the lane-group kernel; its warps per block, cp.async
    # ring depth (steps of 16 tokens, 8 KB each at D=128) and target blocks; the default since
    # it measured 1.00x dense SDPA at 32K on the H200 against the lane-group kernel's 0.85x
    native_mma: bool = True
    native_warps: int = 4
    native_stages: int = 3
    native_target_blocks: int = 132 * 2

    def __post_init__(self):
        for name in ("unroll", "num_warps", "target_blocks", "dims_per_lane", "mma_warps",
                     "mma_target_blocks", "native_warps", "native_target_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"DirectTuning.{name} must be at least 1, got {getattr(self, name)}")
        if self.mma_stages is not None and self.mma_stages < 0:
            raise ValueError(f"DirectTuning.mma_stages must be >= 0 or None, got {self.mma_stages}")
        if self.mma_sub is not None and self.mma_sub < 1:
            raise ValueError(f"DirectTuning.mma_sub must be >= 1 or None, got {self.mma_sub}")
        if self.mma_min_blocks < 0:
            raise ValueError(f"DirectTuning.mma_min_blocks must be >= 0, got {self.mma_min_blocks}")
        if self.native_stages < 2:
            raise ValueError(f"DirectTuning.native_stages must be at least 2, got {self.native_stages}")

    def parse(self, text: str) -> DirectTuning:
        """This tuning with the leading fields replaced by the comma-separated integers of
        `text`, in the order of TEXT_FIELDS (0/1 for the flags); e.g. "2,4,264,16,6,264"."""
        try:
            values = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"tuning {text!r} is not comma-separated integers "
                             f"({','.join(TEXT_FIELDS)})") from None
        if not 3 <= len(values) <= len(TEXT_FIELDS) or len(values) == 5:
            raise ValueError(f"tuning {text!r} has {len(values)} values; expected 3, 4 or 6 to "
                             f"{len(TEXT_FIELDS)} of {','.join(TEXT_FIELDS)}")
        changes = {name: bool(value) if name in _FLAGS else value
                   for name, value in zip(TEXT_FIELDS, values, strict=False)}
        return replace(self, **changes)


# the order of DirectTuning.parse's text (the historical KVSTORE_DIRECT_TUNING format)
TEXT_FIELDS = ("unroll", "num_warps", "target_blocks", "dims_per_lane", "mma_warps",
               "mma_target_blocks", "mma_pipe", "mma_stages", "mma_sub", "mma_raw", "mma_early_issue")
_FLAGS = ("mma_pipe", "mma_raw", "mma_early_issue")


def environment_tuning() -> DirectTuning:
    """The tuning $KVSTORE_DIRECT_TUNING, $KVSTORE_DIRECT_MMA, $KVSTORE_DIRECT_MMA_RAW and
    $KVSTORE_DIRECT_NATIVE_MMA ask for (the defaults where unset), read now; what kernels.attention uses when a call
    passes no tuning."""
    return _tuning_from(os.environ.get(TUNING_ENV, ""), os.environ.get(MMA_ENV, "1"),
                        os.environ.get(MMA_RAW_ENV, "1"), os.environ.get(NATIVE_MMA_ENV, ""))


@lru_cache(maxsize=16)
def _tuning_from(text: str, mma: str, mma_raw: str, native_mma: str = "") -> DirectTuning:
    base = DirectTuning(mma=mma != "0", mma_raw=mma_raw != "0")
    if native_mma:
        base = replace(base, native_mma=native_mma != "0")
    return base.parse(text) if text else base
