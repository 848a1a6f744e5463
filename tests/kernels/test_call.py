"""PagedAttentionCall and DirectTuning: the call and the tuning are values passed in, and
kernels/attention.py alone picks the kernel. Runs everywhere (plans only, no GPU)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest

from kernels import attention, direct
from kernels.attention import paged_attention, workspace_nbytes
from kernels.call import PagedAttentionCall
from kernels.layout import PageLayout
from kernels.paging import AttentionShapeError
from kernels.tuning import MMA_ENV, MMA_RAW_ENV, TUNING_ENV, DirectTuning, environment_tuning
from tests.kernels.pages import make_case

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_call_is_a_frozen_value():
    case = make_case("k4v4", head_dim=64, n_kv_heads=2, gqa=2, block_size=16, context_lens=[40],
                     num_queries=1)
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, [40], case.layout, scale=0.1)
    assert call.context_lens == (40,) and (call.num_queries, call.k_head_dim, call.v_head_dim) == (1, 64, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.scale = 1.0
    with pytest.raises(ValueError, match="unknown mask"):
        PagedAttentionCall(case.queries, case.planes, case.block_tables, [40], case.layout, scale=0.1, mask="full")


def test_tuning_text_fills_fields_in_order():
    tuning = DirectTuning().parse("1,8,132,8,4,528,0,2,1,0,0")
    assert tuning == DirectTuning(unroll=1, num_warps=8, target_blocks=132, dims_per_lane=8, mma_warps=4,
                                  mma_target_blocks=528, mma_pipe=False, mma_stages=2, mma_sub=1,
                                  mma_raw=False, mma_early_issue=False)
    assert DirectTuning(mma_raw=False).parse("2,4,264").mma_raw is False  # fields not given stay


@pytest.mark.parametrize("text", ["2,x,264", "2,4", "2,4,264,16,6", "0,4,264", ",".join(["1"] * 12)])
def test_bad_tuning_text_is_refused(text):
    with pytest.raises(ValueError):
        DirectTuning().parse(text)


def test_environment_tuning_is_read_when_asked(monkeypatch):
    for name in (TUNING_ENV, MMA_ENV, MMA_RAW_ENV):
        monkeypatch.delenv(name, raising=False)
    assert environment_tuning() == DirectTuning()
    monkeypatch.setenv(TUNING_ENV, "1,8,528")
    monkeypatch.setenv(MMA_ENV, "0")
    monkeypatch.setenv(MMA_RAW_ENV, "0")
    assert environment_tuning() == DirectTuning(unroll=1, num_warps=8, target_blocks=528, mma=False, mma_raw=False)
    # callers that pass no tuning see the environment as it is now, not as it was at import
    layout = PageLayout(4, 4)
    args = dict(n_q_heads=32, n_kv_heads=8, num_queries=1, k_head_dim=128, v_head_dim=128,
                context_len=1 << 17, block_size=16, layout=layout)
    wide = workspace_nbytes("metal", **args)
    monkeypatch.setenv(TUNING_ENV, "1,8,66")
    assert workspace_nbytes("metal", **args) < wide
    assert workspace_nbytes("metal", **args, tuning=DirectTuning(target_blocks=528)) == wide


def test_tuning_reaches_the_plan():
    case = make_case("k4v4-rot-f16", head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[3000], num_queries=1)
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, scale=128**-0.5)
    lane = [dict(direct.plan_launch(call, DirectTuning(unroll=u, num_warps=w)).split_template)
            for u, w in ((2, 4), (1, 8))]
    assert (lane[0]["UNROLL"], lane[0]["NUM_WARPS"], lane[1]["UNROLL"], lane[1]["NUM_WARPS"]) == (2, 4, 1, 8)
    mma = direct.plan_launch(call, DirectTuning(mma_warps=4, mma_stages=2), kernel="mma")
    assert (dict(mma.split_template)["NUM_WARPS"], dict(mma.split_template)["STAGES"], mma.threads) == (4, 2, 128)


@pytest.mark.parametrize("layout,tuning,kernel", [
    ("k4v4-rot-f16", DirectTuning(), "mma"),       # packed, fp16 queries: tensor cores
    ("k4v4-rot-f16", DirectTuning(mma=False), "lane"),
    ("k4v4", DirectTuning(), "mma"),               # bf16 queries
    ("bf16", DirectTuning(), "mma_native"),        # native 16-bit pages: tensor cores
    ("bf16", DirectTuning(native_mma=False), "lane"),
    ("f32", DirectTuning(), "lane"),               # float32 pages keep float32 math
])
def test_attention_picks_the_cuda_kernel(monkeypatch, layout, tuning, kernel):
    """kernels/attention.py alone decides which split kernel a CUDA call runs."""
    launched = []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan) or plan.output_shape)
    case = make_case(layout, head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1)
    shape = paged_attention(case.queries, case.planes, case.block_tables, case.context_lens, case.layout,
                            scale=0.1, impl="cuda", tuning=tuning)
    assert [plan.kernel for plan in launched] == [kernel] and shape == (1, 8, 1, 128)


def test_kernels_keep_no_module_state_set_through_global():
    offenders = [f"{path.name}:{node.lineno}" for path in sorted(KERNELS.glob("*.py"))
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert not offenders, f"`global` statements in kernels/: {offenders}"


def test_float32_queries_keep_the_lane_kernel(monkeypatch):
    launched = []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan.kernel))
    case = make_case("k8v8", head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1)
    paged_attention(case.queries.astype(mx.float32), case.planes, case.block_tables, case.context_lens,
                    case.layout, scale=0.1, impl="cuda")
    assert launched == ["lane"]


def test_baked_templates_are_the_constants_cuda_kernel_writes():
    """CUDA kernels are compiled per template with its constants written at the head of the
    body, as mx.fast.cuda_kernel writes them for template arguments (so the compiled code is
    the same), and the variant's name carries a digest of them (MLX caches modules by name)."""
    from kernels.launch import baked

    template = (("D", 128), ("CAUSAL", False), ("ROWS16", True), ("KvT", mx.bfloat16), ("OutT", mx.float16))
    suffix, prefix = baked(template)
    assert prefix == ("  constexpr int D = 128;\n  constexpr bool CAUSAL = false;\n"
                      "  constexpr bool ROWS16 = true;\n  using KvT = __nv_bfloat16;\n"
                      "  using OutT = __half;\n\n")
    assert suffix.startswith("_") and suffix[1:].isalnum()
    assert baked(template) == (suffix, prefix)
    assert baked((("D", 64), *template[1:]))[0] != suffix


def test_cuda_launch_finds_its_kernels_once_per_plan(monkeypatch):
    """kernels/cuda.py compiles a plan's kernels on its first launch and every layer's copy
    of the plan (with_inputs) reuses them; the kernels get no template arguments per call."""
    from kernels import cuda

    made, calls = [], []

    def factory(**kwargs):
        made.append(kwargs["name"])

        def kernel(**call):
            calls.append(call["template"])
            return [mx.zeros(shape, dtype) for shape, dtype in
                    zip(call["output_shapes"], call["output_dtypes"], strict=True)]
        return kernel

    monkeypatch.setattr(cuda.mx.fast, "cuda_kernel", factory)
    for cached in (cuda._split_kernel, cuda.merge_kernel, cuda.cuda_mma.split_kernel,
                   cuda.cuda_mma.native_split_kernel):
        cached.cache_clear()
    case = make_case("k4v4", head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1)
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, scale=0.1)
    for _ in range(3):  # three layers of one step
        out = cuda.launch(direct.plan_launch(call, DirectTuning(), kernel="mma"))
    assert out.shape == (1, 8, 1, 128) and len(made) == 2 and calls == [[]] * 6
    for cached in (cuda._split_kernel, cuda.merge_kernel, cuda.cuda_mma.split_kernel,
                   cuda.cuda_mma.native_split_kernel):
        cached.cache_clear()


def test_layers_of_one_step_share_one_route_and_plan(monkeypatch):
    """kernels/attention.py picks the kernel and plans the launch once per call signature:
    the next layer of a decode step (the same shapes, lengths and options, its own arrays)
    takes the cached plan with its own arrays; the next step's lengths take that plan
    respanned (no new pick, the same kernels, their own scalars), and another tuning gets a
    plan of its own."""
    launched = []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan) or plan.output_shape)
    picks = []
    select = attention.select_impl
    monkeypatch.setattr(attention, "select_impl", lambda *a, **k: picks.append(a) or select(*a, **k))

    def layer(seed, context=300, tuning=None):
        tuning = tuning or DirectTuning(mma_warps=5)
        case = make_case("k4v4", head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                         context_lens=[context], num_queries=1, seed=seed)
        paged_attention(case.queries, case.planes, case.block_tables, case.context_lens, case.layout,
                        scale=0.1, impl="cuda", tuning=tuning)
        return case

    layer(1)
    second = layer(2)
    assert len(picks) == 1  # the second layer was routed by the first one's decision
    a, b = launched
    assert a.split_template is b.split_template and a.kernels is b.kernels  # one shared plan
    assert b.split_inputs[0] is not a.split_inputs[0]
    assert b.split_inputs[0].shape == second.queries.shape
    assert all(x is y for x, y in zip(b.split_inputs[2:8], (second.planes[n] for n in second.layout.plane_names),
                                      strict=True))
    layer(3, context=301)  # the next step: new lengths, the plan respanned
    assert len(picks) == 1 and launched[2].meta is not a.meta and launched[2].kernels is a.kernels
    layer(4, tuning=DirectTuning(mma_warps=4))
    assert len(picks) == 2 and launched[3].kernels is not a.kernels
    assert dict(launched[3].split_template)["NUM_WARPS"] == 4 != dict(a.split_template)["NUM_WARPS"]


@pytest.mark.parametrize("layout", ["k4v4", "bf16"])
def test_a_routed_layer_is_launched_without_a_call_object(monkeypatch, layout):
    """The layers of a decode step after the first find their route by the arguments'
    signature and are launched from their own arrays, with no PagedAttentionCall made
    (issue 22: that object, its signature and the plan copy were most of a layer's Python);
    the launch gets exactly the inputs the call path gives it."""
    launched, made = [], []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan) or plan.output_shape)
    real_call = attention.PagedAttentionCall
    monkeypatch.setattr(attention, "PagedAttentionCall", lambda *a, **k: made.append(a) or real_call(*a, **k))
    attention.forget_compiled_kernels()  # no route left from another test
    tuning = DirectTuning(mma_warps=5)
    cases = [make_case(layout, head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                       num_queries=1, seed=seed) for seed in (1, 2)]
    for case in cases:
        out = paged_attention(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, scale=0.1, impl="cuda", tuning=tuning)
        assert out == (1, 8, 1, 128)
    assert len(made) == 1  # the first layer only
    second = cases[1]
    call = real_call(second.queries, second.planes, second.block_tables, second.context_lens,
                     second.layout, scale=0.1)
    expected = direct.with_call_inputs(direct.cached_plan(call, tuning, launched[0].kernel), call)
    routed = launched[1]
    assert routed.kernels is launched[0].kernels and routed.split_template is expected.split_template
    assert len(routed.split_inputs) == len(expected.split_inputs)
    assert all(x is y for x, y in zip(routed.split_inputs, expected.split_inputs, strict=True))
    assert routed.sinks is expected.sinks


@pytest.mark.parametrize("layout,queries,window", [("k4v4", 1, None), ("bf16", 1, None),
                                                    ("bf16", 1, 600), ("k8v4", 4, 600)])
def test_a_respanned_plan_is_the_plan_built_for_its_lengths(monkeypatch, layout, queries, window):
    """A decode step's first layer (new lengths, shapes as before) takes the last plan
    respanned: it equals, field by field, the plan built afresh for those lengths (splits,
    partial shape, per-call scalars, templates), for each split kernel, across lengths
    that change the split count and, with a window, the first visible key."""
    launched = []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan) or plan.output_shape)
    attention.forget_compiled_kernels()
    dtype = mx.float32 if layout == "k8v4" else mx.bfloat16  # k8v4 float32 queries: the lane kernel
    tuning = DirectTuning(target_blocks=24, mma_target_blocks=24, native_target_blocks=24)
    lengths = [1100, 1101, 900, 17, 1200, 300]
    case = make_case(layout, head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[1200],
                     num_queries=queries, seed=7)
    q = case.queries.astype(dtype)
    for length in lengths:
        paged_attention(q, case.planes, case.block_tables, [length], case.layout, scale=0.1,
                        impl="cuda", tuning=tuning, window=window)
    assert len({id(plan.kernels) for plan in launched}) == 1  # one plan, respanned
    assert len({plan.num_splits for plan in launched}) > 2
    fields = [f.name for f in dataclasses.fields(launched[0])
              if f.name not in ("kernels", "arguments", "split_inputs", "sinks", "meta")]
    for length, plan in zip(lengths, launched, strict=True):
        call = PagedAttentionCall(q, case.planes, case.block_tables, [length], case.layout,
                                  scale=0.1, window=window)
        built = direct._build_plan if plan.kernel == "lane" else {
            "mma": direct._build_mma_plan, "mma_native": direct._build_native_mma_plan}[plan.kernel]
        fresh = built(call, tuning)
        assert {f: getattr(plan, f) for f in fields} == {f: getattr(fresh, f) for f in fields}
        assert plan.meta.tolist() == fresh.meta.tolist()
    assert {plan.kernel for plan in launched} == {"lane" if layout == "k8v4" else
                                                  "mma" if layout == "k4v4" else "mma_native"}


def test_a_respanned_plan_checks_its_lengths(monkeypatch):
    """New lengths the block table cannot hold, or one length for a batch of two, are
    refused as check_shape refuses them, not launched from the last step's plan."""
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: plan.output_shape)
    attention.forget_compiled_kernels()
    case = make_case("k4v4", head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1, seed=8)
    args = (case.queries, case.planes, case.block_tables)
    paged_attention(*args, [300], case.layout, scale=0.1, impl="cuda")
    width = case.block_tables.shape[1]
    with pytest.raises(AttentionShapeError, match=f"needs more than {width} blocks"):
        paged_attention(*args, [width * 16 + 1], case.layout, scale=0.1, impl="cuda")
    with pytest.raises(AttentionShapeError, match="2 context lengths"):
        paged_attention(*args, [300, 300], case.layout, scale=0.1, impl="cuda")


def test_a_routed_layer_with_other_shapes_is_planned_again(monkeypatch):
    """Anything in the signature that differs from the routed layer's (a pool that grew, a
    longer block table, another query dtype, a window) makes a call object and a plan of
    its own: the fast path never launches a plan made for other shapes."""
    launched = []
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: launched.append(plan) or plan.output_shape)
    attention.forget_compiled_kernels()
    case = make_case("bf16", head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1, seed=3)
    grown = {name: mx.concatenate([plane, plane]) for name, plane in case.planes.items()}
    wider = mx.concatenate([case.block_tables, case.block_tables], axis=1)
    variants = [
        (case.queries, case.planes, case.block_tables, {}),
        (case.queries, grown, case.block_tables, {}),
        (case.queries, case.planes, wider, {}),
        (case.queries.astype(mx.float16), case.planes, case.block_tables, {}),
        (case.queries, case.planes, case.block_tables, {"window": 64}),
    ]
    for queries, planes, tables, options in variants:
        paged_attention(queries, planes, tables, case.context_lens, case.layout, scale=0.1,
                        impl="cuda", **options)
    paged_attention(*variants[0][:3], case.context_lens, case.layout, scale=0.1, impl="cuda")
    first, grown_plan, wider_plan, f16_plan, windowed, again = launched
    assert len({id(plan.kernels) for plan in launched[:5]}) == 5  # a plan each
    assert again.kernels is first.kernels  # the first variant's route, found again
    assert grown_plan.split_inputs[2] is grown["k"] and wider_plan.split_inputs[-2] is wider
    assert f16_plan.kernel == "lane" and first.kernel == "mma_native"  # float16 queries, bf16 pages
    assert dict(windowed.split_template)["WINDOWED"] is True


def test_a_cached_route_still_needs_its_backend(monkeypatch):
    """A route cached while CUDA was there is not served once it is gone: availability is
    part of the route's key."""
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention.cuda, "launch", lambda plan: plan.output_shape)
    case = make_case("k4v4", head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[300],
                     num_queries=1, seed=5)
    args = (case.queries, case.planes, case.block_tables, case.context_lens, case.layout)
    assert paged_attention(*args, scale=0.1, impl="cuda") == (1, 8, 1, 128)
    monkeypatch.setattr(attention, "cuda_available", lambda: False)
    with pytest.raises(attention.BackendUnavailable):
        paged_attention(*args, scale=0.1, impl="cuda")
