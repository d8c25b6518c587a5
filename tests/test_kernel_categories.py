"""benchmarks/kernel_categories.py and the pure parts of benchmarks/trace_kernels.py: GPU kernel names
as CUDA traces of XLA programs show them put in their categories, the code an HLO dump gives an
instruction deciding for XLA's own fusions, and the busy / idle arithmetic against a brute-force
count of covered nanoseconds."""
import random

import pytest

from benchmarks.kernel_categories import categorize, merged, step_breakdown, union_length
from benchmarks.step_profile import trainer_flags
from benchmarks.trace_kernels import Kernel, code_of, instruction_code

NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "matmul"),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x1x1_0_tnn_align8_warpspecialized", "matmul"),
    ("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_128x128_32x3_tn_align8", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("gemm_fusion_dot_123", "matmul"),
    ("triton_gemm_dot_4", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("zerojax_flash_forward", "attention"),
    ("zerojax_flash_backward", "attention"),
    ("MemcpyH2D", "host transfer"),
    ("MemcpyD2H", "host transfer"),
    ("MemcpyDtoH", "host transfer"),
    ("MemcpyD2D", "copies"),
    ("Memset", "copies"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "collective"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_bf16", "collective"),
    ("all-gather-start", "collective"),
    ("loop_multiply_fusion", "elementwise"),
    ("input_reduce_fusion_3", "elementwise"),
    ("loop_convert_fusion_12", "elementwise"),
    ("wrapped_transpose", "elementwise"),
    ("loop_dynamic_update_slice_fusion", "copies"),
    ("copy_bitcast_fusion_17", "copies"),
    ("some_library_kernel", "other"),
]


@pytest.mark.parametrize("name, expected", NAMES)
def test_kernel_names(name, expected):
    assert categorize(name) == expected


CODE = [
    ("input_reduce_fusion", "transpose(jvp())/reduce_max chunked_cross_entropy /x/zerojax/models/llama.py", "loss"),
    ("loop_exponential_fusion", "jvp(jit(log_softmax))/exp fused_cross_entropy /x/zerojax/models/gpt2.py", "loss"),
    ("loop_multiply_fusion", "mul update_moment /venv/site-packages/optax/_src/transform.py", "optimizer"),
    ("input_reduce_fusion_2", "reduce_sum _global_norm /x/zerojax/engine/step.py", "optimizer"),
    ("loop_add_fusion", "add _warmup_lr.<locals>.schedule /x/zerojax/optim.py", "optimizer"),
    ("input_reduce_fusion_5", "jvp()/while/body/rsqrt _rms_norm /x/zerojax/models/llama.py", "norm"),
    ("loop_add_fusion_2", "add RMSNorm.__call__ /x/flax/nnx/nn/normalization.py", "norm"),
    ("loop_concatenate_fusion", "while/body/mul _rotate /x/zerojax/models/llama.py", "rope"),
    # an initializer named `_normal` is not a norm; a gemm inside the loss is still a matmul
    ("loop_multiply_fusion_3", "mul _normal /x/zerojax/models/llama.py", "elementwise"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN", "dot_general chunked_cross_entropy /x/llama.py", "matmul"),
]


@pytest.mark.parametrize("name, code, expected", CODE)
def test_code_decides_for_fusions(name, code, expected):
    assert categorize(name, code) == expected


def _covered(intervals) -> set[int]:
    return {t for s, e in intervals for t in range(s, e)}


def test_union_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        intervals = [(s, s + rng.randint(0, 15)) for s in (rng.randint(0, 60) for _ in range(rng.randint(0, 8)))]
        assert union_length(intervals) == len(_covered(intervals))
        spans = merged(intervals)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # disjoint, sorted, not touching
        assert _covered(spans) == _covered(intervals)


def test_breakdown_adds_up_to_the_span():
    rng = random.Random(1)
    for _ in range(100):
        kernels = []
        for _ in range(rng.randint(1, 10)):
            s = rng.randint(0, 80)
            kernels.append((rng.choice(["matmul", "elementwise", "host transfer"]), s, s + rng.randint(1, 20)))
        b = step_breakdown(kernels, steps=2)
        span = max(e for *_, e in kernels) - min(s for _, s, _ in kernels)
        compute = _covered([(s, e) for c, s, e in kernels if c != "host transfer"])
        assert b["span"] == span / 2
        assert b["idle"] == (span - len(compute)) / 2
        assert sum(b["categories"].values()) + b["idle"] - b["concurrent"] == pytest.approx(b["span"])


def test_breakdown_of_nothing():
    assert step_breakdown([], 3)["span"] == 0.0


DUMP = """HloModule jit_train_step, is_scheduled=true

ENTRY %main.1 (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0), metadata={op_name="args[0]"}
  ROOT %loop_add_fusion.3 = f32[8] fusion(%p), metadata={op_name="jit(train_step)/jvp()/add" stack_frame_id=2}
}

FileNames
1 "/x/zerojax/models/llama.py"

FunctionNames
1 "Llama.__call__"
2 "_rms_norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=480 end_line=480 column=0 end_column=20}
2 {file_name_id=1 function_name_id=2 line=318 end_line=318 column=4 end_column=30}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
"""


def test_instruction_code_from_a_dump():
    code = instruction_code(DUMP)
    assert code["loop_add_fusion.3"] == "jvp()/add _rms_norm /x/zerojax/models/llama.py"
    assert code["p"] == "args[0]"
    table = {("jit_train_step", "loop_add_fusion.3"): "a", ("", "loop_add_fusion_3"): "b"}
    assert code_of(Kernel("k", 0, 1, "jit_train_step", "loop_add_fusion.3"), table) == "a"
    assert code_of(Kernel("loop_add_fusion_3", 0, 1), table) == "b"  # no hlo_op stat: the kernel's name
    assert code_of(Kernel("nvjet", 0, 1), table) == ""


def test_tiny_flags_keep_the_step_and_shrink_the_shape():
    flags = trainer_flags("llama8b-qlora", tiny=True, total_steps=7)
    assert flags[flags.index("--model") + 1] == "tiny-llama"
    assert flags[flags.index("--seq-len") + 1] == "64"
    assert flags[flags.index("--micro-batch") + 1] == "2"
    assert flags[flags.index("--quantize") + 1] == "nf4" and flags[flags.index("--steps") + 1] == "7"
    gpt2 = trainer_flags("gpt2-large", tiny=True, total_steps=3)
    assert gpt2[gpt2.index("--model") + 1] == "tiny" and "--master-split" in gpt2
    assert trainer_flags("gpt2-large", tiny=False, total_steps=3)[:2] == ["--model", "large"]
