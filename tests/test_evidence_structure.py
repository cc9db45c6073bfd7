"""Gates 0-2 on the demo TMA matmul, compiled with no GPU for several targets."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl

from wsattn.evidence import demo, ladder, structure
from wsattn.evidence.compile_gate import compile_kernel


def _compile(num_warps, cc):
    cs = demo.matmul_ws_spec(num_warps).compile_spec(cc)
    res = compile_kernel(cs["fn"], cs["signature"], cs["constexprs"], cs["options"], cc)
    assert res.ok, res.error
    return structure.analyse(res, cs["fn"], cs["signature"], cs["options"])


@pytest.fixture(scope="module")
def sm90_4w():
    return _compile(4, 90)


def test_formed_on_sm90_with_4_warps(sm90_4w):
    s = sm90_4w
    assert s.ws_requested and s.ws_formed and s.decline_reason is None
    assert s.ws_pass == "nvgpu-warp-specialization"
    assert s.mma == "wgmma" and s.tma
    assert [p.name for p in s.partitions] == ["default", "partition0", "partition1"]
    assert [p.warps for p in s.partitions] == [4, 4, 4]
    assert s.partitions[0].role == "TMA producer"
    assert all("MMA" in p.role and "epilogue store" in p.role for p in s.partitions[1:])
    assert s.requested_registers == [232, 232] and [p.registers for p in s.partitions[1:]] == [232, 232]
    assert "dec 40" in s.setmaxnreg and "inc 232" in s.setmaxnreg
    assert s.num_warps_total == 12  # one producer + two consumer warpgroups
    assert s.sass["HGMMA"] > 0 and s.sass["UTMALDG"] > 0 and s.sass["USETMAXREG"] > 0
    assert s.mbarriers > 0 and s.regs_per_thread and s.shared_bytes > 64 * 1024


def test_declined_on_sm90_with_8_warps_says_why():
    s = _compile(8, 90)
    assert s.ws_requested and not s.ws_formed and not s.partitions
    assert "num_warps=8" in s.decline_reason
    assert "NOT FORMED" in structure.summary(s)


def test_formed_on_sm100_through_the_automatic_pass():
    s = _compile(4, 100)
    assert s.ws_formed and s.ws_pass == "tritongpu-automatic-warp-specialization"
    assert s.mma == "tcgen05" and s.sass["UTCMMA"] > 0
    roles = {p.role for p in s.partitions}
    assert "MMA" in roles and "TMA producer" in roles


def test_sm120_takes_the_mma_sync_path():
    """Consumer Blackwell: the sm_100 story (tcgen05) is not its story."""
    r = ladder.climb(demo.matmul_ws_4w(), "sm_120", ladder.Config(max_gate=2))
    assert r.gates[0].data["mma"] == "mma.sync" and r.gates[0].data["tma"]
    assert "mma.sync" in r.verdict and "tcgen05" not in r.verdict
    assert r.gates[2].data["sass"]["HMMA"] > 0 and r.gates[2].data["sass"]["HGMMA"] == 0


def test_compile_failure_is_a_failed_gate_not_a_crash():
    r = ladder.climb(demo.broken_spec(), "sm_90", ladder.Config())
    assert [g.status for g in r.gates] == ["pass", "FAIL"]
    assert r.highest_gate == 0
    assert "equal reduction dimensions" in r.gates[1].detail
    assert "FAILS compile" in r.verdict and "compiles," not in r.verdict


@pytest.mark.parametrize("bad, expected", [
    pytest.param({"signature": {"x_ptr": "*fp16", "y_ptr": "*fp16"}}, "has no argument 'y_ptr'", id="extra-arg"),
    pytest.param({"signature": {}}, "'x_ptr' of kernel broken_kernel is missing", id="missing-arg"),
    pytest.param({"constexprs": {}}, "constexpr 'BLOCK' of kernel broken_kernel has no value", id="no-constexpr"),
    pytest.param({"constexprs": {"BLOCK": 33}}, "power of 2", id="constexpr-does-not-compile"),
])
def test_bad_spec_gives_one_line(bad, expected):
    cs = {"fn": demo.broken_kernel, "signature": {"x_ptr": "*fp16"}, "constexprs": {"BLOCK": 32},
          "options": {"num_warps": 4}, **bad}
    res = compile_kernel(cs["fn"], cs["signature"], cs["constexprs"], cs["options"], 90)
    assert not res.ok and expected in res.error and "\n" not in res.error


def test_unknown_target_fails_gate_0():
    r = ladder.climb(demo.matmul_ws_4w(), "sm_89", ladder.Config())
    assert r.highest_gate == -1 and "unknown target 'sm_89'" in r.gates[0].detail


# --------------------------------------------------------------------------- parsers on text

TTGIR = """module attributes {"ttg.num-warps" = 4 : i32} {
  tt.func public @k() {
    ttg.warp_specialize(%a) attributes {requestedRegisters = array<i32: 24, 200>}
    default {
      ttg.warp_yield
    }
    partition0(%x: i32) num_warps(1) {
      ttng.async_tma_copy_global_to_local %d[%c] %s, %b, %t {async_task_id = array<i32: 0>} : x
      ttg.warp_return
    }
    partition1(%x: i32) num_warps(8) {
      %s = ttng.warp_group_dot %a, %b, %c : x
      %p = math.exp2 %s : x
      ttg.warp_return
    } : (i32) -> ()
    tt.return
  }
}
"""


def test_partition_parser_reads_warps_registers_and_roles():
    parts, regs = structure.parse_partitions(TTGIR)
    assert regs == [24, 200]
    assert [(p.name, p.warps, p.registers) for p in parts] == [
        ("default", 4, None), ("partition0", 1, 24), ("partition1", 8, 200)]
    assert parts[0].role.startswith("idle")
    assert parts[1].role == "TMA producer"
    assert parts[2].role == "MMA + softmax/correction"


def test_ptx_and_sass_readers():
    ptx = ("setmaxnreg.dec.sync.aligned.u32 \t40;\n@%p1 mbarrier.init.shared::cta.b64 [%r1], 1;\n"
           "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {...};\n"
           "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [x];\n")
    assert structure.setmaxnreg_values(ptx) == ["dec 40"]
    assert structure.mbarrier_count(ptx) == 1
    assert structure.mma_family(ptx) == "wgmma" and structure.uses_tma(ptx)
    assert structure.mma_family("mma.sync.aligned.m16n8k16") == "mma.sync"
    sass = "--:-:1:-:1\tHGMMA.64x128x16.F32 gdesc;\n--:-:-:-:2\t@P0 STL [R1], R2;\n--:-:-:-:2\tUTMALDG.2D [UR4];\n"
    census = structure.sass_census(sass)
    assert census["HGMMA"] == 1 and census["STL"] == 1 and census["UTMALDG"] == 1 and census["LDL"] == 0


def test_known_reasons_on_sm90_come_from_the_kernel():
    src_else = demo.matmul_ws_kernel  # no else block, 4 warps, a dot in the loop
    assert structure.known_decline_reasons(90, src_else, {}, {"num_warps": 4}, None) == []
    sig = {"q": "tensordesc<bf16[128,64]>"}
    assert any("BLOCK_M=128" in r for r in structure.known_decline_reasons(90, src_else, sig, {}, None))
    assert structure.known_decline_reasons(100, src_else, sig, {"num_warps": 8}, None) == []


def test_library_kernel_without_a_code_path_is_not_run_never_a_pass():
    from wsattn.evidence import library
    r = ladder.climb(library.get("prefill_gluon"), "sm_100", ladder.Config())
    assert [g.status for g in r.gates] == ["pass", "not run"]
    assert "no code path for sm_100" in r.verdict and "compiles" not in r.verdict


def test_library_merge_kernel_climbs_to_structure():
    from wsattn.evidence import library
    r = ladder.climb(library.get("merge_states"), "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2, r.verdict
    assert r.gates[2].data["regs_per_thread"] and not r.gates[2].data["ws_requested"]


@triton.jit
def _two_ws_loops(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Two warp-specialized loops, like causal attention's masked and unmasked halves."""
    pid_m = tl.program_id(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    half = K // BLOCK_K // 2
    for k in tl.range(0, half, warp_specialize=True):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([0, k * BLOCK_K]).T, acc)
    for k in tl.range(half, K // BLOCK_K, warp_specialize=True):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([0, k * BLOCK_K]).T, acc)
    c_desc.store([pid_m * BLOCK_M, 0], acc.to(tl.float16))


def test_sm90_compile_failure_names_the_known_cause():
    """Two specialized loops break the sm_90 pass (FACTS.md: causal attention); the failed
    gate says where it failed and which known cause is present, and sm_100 still forms."""
    from wsattn.evidence.spec import KernelSpec

    def compile_spec(cc):
        sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "M": "i32", "N": "i32", "K": "i32"}
        return {"fn": _two_ws_loops, "signature": sig,
                "constexprs": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, "options": {"num_warps": 4}}
    spec = KernelSpec("two_loops", compile_spec=compile_spec)
    r = ladder.climb(spec, "sm_90", ladder.Config(max_gate=2))
    assert r.gates[1].status == "FAIL" and "ttgir stage" in r.gates[1].detail
    assert "2 warp-specialized loops" in r.gates[1].detail
    r = ladder.climb(spec, "sm_100", ladder.Config(max_gate=2))
    assert r.highest_gate == 2 and r.gates[2].data["ws_formed"]
