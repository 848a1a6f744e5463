"""Every Metal kernel source, syntax- and type-checked here with a host C++ compiler.

No Metal compiler exists off macOS (the Metal tests themselves run on the macos-14 workflow,
.github/workflows/macos.yml), so this builds the translation units mx.fast.metal_kernel
would build for real launch plans (tests/kernels/metal_syntax.py) and compiles them with
`-fsyntax-only` against stand-ins for metal_stdlib (tests/kernels/metal_stand_ins.h),
instantiating each template with the plan's values. A planted error in a temporary copy of
the sources must make it fail. Skips, saying why, where no C++ compiler is installed.
"""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest

from kernels import direct
from kernels.call import PagedAttentionCall
from kernels.sources import PACKAGE, source_tree
from kernels.tuning import DirectTuning
from tests.kernels.metal_syntax import Unit, check_unit, combined_unit, find_compiler, plan_units
from tests.kernels.pages import make_case

COMPILER = find_compiler()
needs_compiler = pytest.mark.skipif(
    COMPILER is None,
    reason="no C++ compiler (clang++, g++ or c++ on PATH, or $KVSTORE_CXX): the Metal sources "
           "are not syntax-checked; apt-get install g++ (or clang) to run this check")

# (layout, head dim, queries, options): every template branch of the Metal split kernel
# (native bf16/f16/f32 pages, packed 8/8, 8/4, 4/4, rotated keys, causal, windowed; head
# dims 64/128/256 give DPL 8/16 and lane groups of 4-16) and of the merge (sinks or none,
# bf16/f16/f32 output)
CASES = [
    ("bf16", 128, 1, {}),
    ("f16", 64, 4, {"mask": "causal"}),
    ("f32", 256, 1, {"sinks": True}),
    ("bf16-rot", 128, 2, {"window": 64}),
    ("k8v8", 128, 1, {}),
    ("k8v4", 64, 1, {"sinks": True}),
    ("k4v4", 256, 8, {"mask": "causal"}),
    ("k4v4-rot", 128, 1, {"window": 100}),
    ("k8v8-f16", 128, 3, {"mask": "causal", "sinks": True}),
]


def case_plan(layout: str, head_dim: int, num_queries: int, options: dict):
    case = make_case(layout, head_dim=head_dim, n_kv_heads=2, gqa=2, block_size=16,
                     context_lens=[300], num_queries=num_queries)
    sinks = mx.zeros((4,), dtype=mx.float32) if options.get("sinks") else None
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, [300], case.layout,
                              scale=head_dim ** -0.5, mask=options.get("mask"),
                              window=options.get("window"), sinks=sinks)
    return direct.plan_launch(call, DirectTuning())


def all_units(tree=PACKAGE) -> dict[str, Unit]:
    """Distinct translation units over CASES, named by case and kernel."""
    units, seen = {}, set()
    for layout, head_dim, num_queries, options in CASES:
        for kernel, unit in plan_units(case_plan(layout, head_dim, num_queries, options), tree).items():
            if unit.text not in seen:
                seen.add(unit.text)
                units[f"{kernel}: {layout} D={head_dim} L={num_queries} {options}"] = unit
    return units


def failures(units: dict[str, Unit]) -> dict[str, str]:
    """name -> compiler diagnostics of each unit that does not compile: all units in one
    compiler run, then one run per unit only if that one failed (to name the culprits)."""
    if check_unit(COMPILER, combined_unit(list(units.values()))).returncode == 0:
        return {}
    out = {}
    for name, unit in units.items():
        result = check_unit(COMPILER, unit.text)
        if result.returncode != 0:
            out[name] = result.stderr
    return out


@needs_compiler
def test_every_metal_source_compiles_against_the_stand_ins():
    units = all_units()
    assert sum(name.startswith("split") for name in units) == len(CASES)
    assert any(name.startswith("merge") for name in units)
    broken = failures(units)
    assert not broken, "\n\n".join(f"{name}:\n{errors[:4000]}" for name, errors in broken.items())


# (file, text there, planted replacement, what the compiler must name)
PLANTED = [
    ("metal_split.metal", "s[u][i] = metal::fma(k_scale, dot, k_offset * q_sum[i]);",
     "s[u][i] = metal::fma(k_scale, dot, k_ofset * q_sum[i]);", "k_ofset"),  # a typo
    ("split_softmax.h", "chunk_max = KV_MAX(chunk_max, s[u][i]);",
     "chunk_max = KV_MAX(chunk_max, s[u]);", "max"),  # float vs float*, in a file CUDA shares
    ("metal_merge.metal", "best = metal::max(best, sink);", "best = metal::max(best, 1);", "max"),  # float vs int
    ("split_epilogue.h", "total += w * sh_l[p][i];", "total += w * sh_l[p][i]", "expected"),  # shared file
    ("metal_loads.metal", "kv_code<K_BITS>(words[", "kv_code<K_BITS, 2>(words[", "kv_code"),  # bad template
]


@needs_compiler
@pytest.mark.parametrize("file, original, planted, named", PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_error_fails_the_check(tmp_path, file, original, planted, named):
    """The check can fail: the same units from a copy of kernels/ with one error planted."""
    for path in PACKAGE.root.iterdir():
        if path.name.endswith((".metal", ".h")):
            shutil.copyfile(path, tmp_path / path.name)
    text = (tmp_path / file).read_text()
    assert text.count(original) == 1, f"{file} no longer holds {original!r}: update PLANTED"
    (tmp_path / file).write_text(text.replace(original, planted))
    result = check_unit(COMPILER, combined_unit(list(all_units(source_tree(tmp_path)).values())))
    assert result.returncode != 0, f"a planted error in {file} compiled cleanly"
    assert named in result.stderr and "error" in result.stderr, result.stderr[:4000]
