"""The Gluon sm_90 prefill kernel, fixed-length and varlen (one kernel, VARLEN a constexpr).

CPU: compile for sm_90 with no GPU and check the structure the kernel is built for
(three partitions, their warps and registers, setmaxnreg, wgmma, TMA, no spills) in both
builds, the launchers' grids and arguments, and the qualification rules api.py relies on.
sm90: numerics through the public API against the float64 reference, NaN-poisoned outputs.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from dataclasses import replace

import pytest
import torch

from wsattn.evidence.compile_gate import sass_listing
from wsattn.kernels import prefill_gluon as pg

from conftest import assert_close, assert_lse_close

pytest.importorskip("triton.experimental.gluon")


@functools.lru_cache(maxsize=None)
def _compile(head_dim: int, causal: bool, varlen: bool = False, **overrides):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    settings = pg.settings_for(head_dim, causal, **overrides)
    spec = pg.compile_spec(cc=90, head_dim=head_dim, dtype="bf16", causal=causal,
                           settings=settings, varlen=varlen)
    src = GluonASTSource(spec["fn"], spec["signature"], spec["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])


COMPILE_CASES = [pytest.param(d, c, id=f"D{d}-{'causal' if c else 'full'}")
                 for d in (64, 128) for c in (False, True)]


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_structure(head_dim, causal):
    """Producer warp + the default settings' 4-warp consumer warpgroups (two at head dim
    128, three at 64), registers handed over, wgmma, TMA."""
    _assert_ws_structure(_compile(head_dim, causal), pg.settings_for(head_dim, causal), head_dim)


def _assert_ws_structure(k, s, head_dim):
    n = s.CONSUMERS
    assert n == (3 if head_dim == 64 else 2)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]

    ws = re.findall(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: ([0-9, ]+)>", ttgir)
    assert len(ws) == 1, "expected exactly one ttg.warp_specialize op"
    assert [int(r) for r in ws[0].split(",")] == [s.CONSUMER_REGS] * (n - 1) + [s.PRODUCER_REGS]
    # The default partition is consumer 0; the workers are the other consumers and the producer.
    parts = re.findall(r"^\s*partition(\d+)\(.*num_warps\((\d+)\)", ttgir, re.M)
    assert [(int(i), int(w)) for i, w in parts] == [(i, 4) for i in range(n - 1)] + [(n - 1, 1)]
    assert k.metadata.num_warps == 4 * n + 4  # n consumer warpgroups + 1 producer padded to 4

    # Both consumers run wgmma; the producer issues the TMA loads.
    assert ttgir.count("ttng.warp_group_dot") >= 4
    assert "ttng.async_tma_copy_global_to_local" in ttgir
    assert "ttng.async_tma_copy_local_to_global" in ttgir  # O leaves through TMA

    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert ("dec", str(s.PRODUCER_REGS)) in regs, regs
    assert ("inc", str(s.CONSUMER_REGS)) in regs, regs
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", ptx)
    assert "cp.async.bulk.tensor" in ptx
    assert k.metadata.shared <= 232448  # fits the sm_90 227 KB per block


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_no_spills(head_dim, causal, varlen):
    """ptxas must keep S, both P register sets and O in registers: spills in the loop (2-stage
    ring, D=128) once cost 40%. One register parked across the kernel entry is tolerated."""
    sass = sass_listing(_compile(head_dim, causal, varlen).asm["cubin"])
    assert "HGMMA" in sass and "UTMALDG" in sass
    spills = re.findall(r"\b(LDL|STL)(?:\.\w+)*\b", sass)
    assert len(spills) <= 2, f"{len(spills)} local-memory (spill) instructions in SASS"


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_sm90_one_loop_structure(head_dim, varlen):
    """ONE_LOOP (causal; the default at D64): the partitions, registers and GEMMs of the
    two-loop build, no spills (ptxas -v), and one softmax body a consumer fewer: the
    prologue and one loop body where ONE_LOOP=False has the prologue, the unmasked loop and
    the masked loop (exponentials in the PTX, two thirds of the other build's)."""
    s = pg.settings_for(head_dim, True, ONE_LOOP=True)
    k = _compile(head_dim, True, varlen, ONE_LOOP=True)
    _assert_ws_structure(k, s, head_dim)
    ptx = k.asm["ptx"]
    assert _ptxas_spill_bytes(ptx) == [0, 0]
    ex2 = ptx.count("ex2.approx")
    two_loop_ex2 = _compile(head_dim, True, varlen, ONE_LOOP=False).asm["ptx"].count("ex2.approx")
    assert ex2 > 0 and 3 * ex2 == 2 * two_loop_ex2


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_varlen_structure(head_dim, causal):
    """The VARLEN build of the plain grid (compact_varlen=False: what packs too large for
    the tile table take) forms the same partitions, registers and GEMMs as the fixed one,
    spills nothing (ptxas -v), reads cu_seqlens, leaves surplus programs before any
    barrier or partition exists, and keeps both O paths: TMA for boxes inside a sequence,
    a masked register store for the box that runs past its end."""
    k = _compile(head_dim, causal, True, compact_varlen=False)
    _assert_ws_structure(k, pg.settings_for(head_dim, causal), head_dim)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert _only_entry_parked_spills(sass_listing(k.asm["cubin"]))
    # The early exit: a return, then the barriers and the partitions.
    exit_at = ttgir.index("tt.return")
    assert exit_at < ttgir.index("ttng.init_barrier") < ttgir.index("ttg.warp_specialize(")
    assert re.search(r"ld\.global(\.\w+)*\.b32", ptx), "cu_seqlens are read in the kernel"
    assert re.search(r"st\.global(\.\w+)*\.b16", ptx), "no masked register store of O"
    assert "cp.async.bulk.tensor" in ptx and "ttng.async_tma_copy_local_to_global" in ttgir


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_compact_varlen_structure(head_dim, causal):
    """compact_varlen=True (the default: the tile-table grid): the varlen build's
    partitions, registers and GEMMs, no spills, the early exit before any barrier, and the
    table read in the kernel (the grid size locates its second row); tiles is an argument
    of this build and a None constexpr of every other."""
    k = _compile(head_dim, causal, True)
    s = pg.settings_for(head_dim, causal)
    assert s.compact_varlen
    _assert_ws_structure(k, s, head_dim)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert _ptxas_spill_bytes(ptx) == [0, 0]
    assert ttgir.index("tt.return") < ttgir.index("ttng.init_barrier")
    assert "%nctaid.x" in ptx, "the table's second row starts at the grid size"
    # (the bounded-V build addresses its CTA's tensor-map scratch by the grid, so the plain
    # grid without it is the build that must not read the grid size)
    assert "%nctaid.x" not in _compile(head_dim, causal, True, compact_varlen=False,
                                       varlen_bounded_v=False).asm["ptx"]
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, settings=s, varlen=True)
    assert spec["signature"]["tiles"] == "*i32" and spec["constexprs"]["VARLEN"] == 2
    assert pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True) == spec
    plain = pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True, plain_grid=True)
    assert plain["constexprs"]["tiles"] is None and plain["constexprs"]["VARLEN"] is True
    fixed = pg.compile_spec(head_dim=head_dim, causal=causal, settings=s)
    assert fixed["constexprs"]["tiles"] is None and fixed["constexprs"]["VARLEN"] is False


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_bounded_v_structure(head_dim, causal):
    """varlen_bounded_v (the default varlen build): the tile-table build's partitions,
    registers and GEMMs, no spills, and the producer making one tensor map on the device
    (tensormap.replace, then the fence that publishes it) for a key tile past its sequence,
    its template clear of every initialised mbarrier; v_rows is an argument of this build and a None constexpr of the build with the setting
    off, whose PTX makes no tensor map and whose shared memory is the same."""
    s = pg.settings_for(head_dim, causal)
    assert s.varlen_bounded_v
    k = _compile(head_dim, causal, True)
    _assert_ws_structure(k, s, head_dim)
    ptx = k.asm["ptx"]
    assert _ptxas_spill_bytes(ptx) == [0, 0]
    unbounded = _compile(head_dim, causal, True, varlen_bounded_v=False)
    assert k.metadata.shared == unbounded.metadata.shared
    assert "tensormap.replace" in ptx and "fence.proxy.tensormap" in ptx
    assert "tensormap" not in unbounded.asm["ptx"]
    _assert_map_template_clear_of_barriers(ptx)
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True)
    assert spec["signature"]["v_rows"] == "*bf16" and spec["constexprs"]["BOUNDED_V"] is True
    off = pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True,
                          settings=pg.settings_for(head_dim, causal, varlen_bounded_v=False))
    assert off["constexprs"]["v_rows"] is None and off["constexprs"]["BOUNDED_V"] is False
    assert pg.compile_spec(head_dim=head_dim, causal=causal, settings=s)["constexprs"][
        "BOUNDED_V"] is False  # fixed length: 3-D descriptors already bound each sequence


# ptxas -v spill bytes (stores, loads) of the paged builds, the rest none. D128 without a
# mask (two consumers on the unrolled loop, the producer at 24 registers): at pages of 8,
# 16 and 32 (16, 8 and 4 boxes a tile) one 4-byte value is stored at the kernel entry,
# before the first setmaxnreg, and reloaded five times by the consumers and the producer;
# at pages of 128 (one box a tile, box == BLOCK_N) five words (20 bytes) are stored there
# and reloaded once by the producer ahead of its key loop (the SASS of these builds).
PAGED_SPILL_BYTES = {(128, False, 8): [4, 20], (128, False, 16): [4, 20],
                     (128, False, 32): [4, 20], (128, False, 128): [20, 20]}
# The default build's key tiles are BLOCK_N = 128 rows (settings_for); every page size that
# paged_supported takes is compiled, each box shape in every mask and head dim: boxes
# smaller than the tile (16: eight a tile, 64: two), one box a tile (128), a page of
# several tiles (256); pages 8 (sixteen boxes, the most), 32 and 512 repeat those shapes
# with other counts, so a case or two each.
PAGED_CASES = [pytest.param(d, c, page, id=f"D{d}-{'causal' if c else 'full'}-{page}")
               for page in (16, 64, 128, 256) for d in (64, 128) for c in (False, True)] + [
    pytest.param(d, c, page, id=f"D{d}-{'causal' if c else 'full'}-{page}")
    for d, c, page in ((128, False, 8), (64, True, 8), (128, True, 32), (64, False, 512))]


@pytest.mark.parametrize("head_dim, causal, page", PAGED_CASES)
def test_sm90_paged_structure(head_dim, causal, page):
    """The paged build (page > 0): the varlen build's partitions, registers and GEMMs, its
    shared memory within 32 bytes, the spills recorded above only, min(page, BLOCK_N)-row
    boxes (BLOCK_N / that many TMA loads of K and of V a tile), the last page's tensor map
    made on the device, its template clear of every initialised mbarrier; block_table, bt_stride, bt_width, page_stride and v_rows are
    arguments of this build and None constexprs of every other."""
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True, page=page)
    k = _compile_spec(spec)
    s = pg.settings_for(head_dim, causal)
    # the build the launcher picks for a chunk past the one-consumer rules
    assert pg.varlen_call_settings(head_dim, causal, 2048, 32768) == s
    _assert_ws_structure(k, s, head_dim)
    ptx = k.asm["ptx"]
    assert _ptxas_spill_bytes(ptx) == PAGED_SPILL_BYTES.get((head_dim, causal, page), [0, 0])
    assert abs(k.metadata.shared - _compile(head_dim, causal, True).metadata.shared) <= 32
    assert "tensormap.replace" in ptx and "fence.proxy.tensormap" in ptx
    _assert_map_template_clear_of_barriers(ptx)
    box = min(page, s.BLOCK_N)
    assert f"[1,{box},{head_dim}]" in spec["signature"]["k_desc"]
    assert spec["constexprs"]["PAGE"] == page and spec["signature"]["block_table"] == "*i32"
    plain = pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True)
    assert plain["constexprs"]["PAGE"] == 0
    assert all(plain["constexprs"][a] is None
               for a in ("block_table", "bt_stride", "bt_width", "page_stride"))
    with pytest.raises(ValueError, match="page=24"):
        pg.compile_spec(head_dim=head_dim, causal=causal, varlen=True, page=24)


def _compile_spec(spec):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(spec["fn"], spec["signature"], spec["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])


def test_paged_supported_page_sizes():
    """Pages of whole 8-row swizzle atoms that tile a key tile or are tiled by it."""
    assert [p for p in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
            if pg.paged_supported(p, 128)] == [8, 16, 32, 64, 128, 256, 512]
    assert not pg.paged_supported(192, 128) and pg.paged_supported(64, 64)


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_fixed_build_has_no_varlen_code(head_dim, causal):
    """VARLEN=False compiles the varlen code away: no cu_seqlens loads, no early exit, no
    element-wise O store (the fixed build's only global stores are the LSE's 32-bit ones)."""
    k = _compile(head_dim, causal)
    ptx = k.asm["ptx"]
    assert not re.search(r"ld\.global", ptx)
    assert not re.search(r"st\.global(\.\w+)*\.b16", ptx)
    assert k.asm["ttgir"].count("tt.return") == 1


def test_settings_are_frozen_and_overridable():
    s = pg.settings_for(128, False, PINGPONG=True)
    assert s.PINGPONG and s.STAGES == pg.settings_for(128, False).STAGES
    with pytest.raises(Exception):
        s.STAGES = 5
    with pytest.raises(TypeError, match="ordered"):  # no gain measured: not a setting (notes)
        pg.settings_for(128, True, ordered=True)
    for d in pg.GLUON_HEAD_DIMS:
        assert pg.settings_for(d).smem_bytes(d) <= 232448


# --------------------------------------------------------------------------- 3 consumers

C3_CASES = [pytest.param(c, id=f"D64-{'causal' if c else 'full'}") for c in (False, True)]


def _only_entry_parked_spills(sass: str) -> bool:
    """Local memory only for one register parked across the kernel entry: at most one store,
    before the first setmaxnreg, and each load right after a partition's setmaxnreg (what
    the D128 plain-grid varlen build does since P packs by pairs), none in any loop."""
    lines = [ln for ln in sass.splitlines() if ln.startswith("-")]
    first = next((i for i, ln in enumerate(lines) if "USETMAXREG" in ln), len(lines))
    stores = [i for i, ln in enumerate(lines) if re.search(r"\bSTL\b", ln)]
    loads = [i for i, ln in enumerate(lines) if re.search(r"\bLDL\b", ln)]
    after_setmaxnreg = all(any("USETMAXREG" in ln for ln in lines[max(0, i - 4):i])
                           for i in loads)
    return len(stores) <= 1 and all(i < first for i in stores) and after_setmaxnreg


def _ptxas_spill_bytes(ptx: str) -> list[int]:
    """Spill store and load bytes that `ptxas -v` reports for the PTX (sm_90a)."""
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx",
                              "-o", f"{tmp}/k.o"], capture_output=True, text=True, check=True)
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert found, res.stderr
    return [int(n) for pair in found for n in pair]


def _barriers_and_map_templates(ptx: str) -> tuple[set[int], set[int]]:
    """The shared-memory offsets (from global_smem) of every mbarrier.init and of every
    tensor-map template (tensormap.replace's operand) in PTX: each address must resolve to
    a constant offset from global_smem, else the parse is wrong and the assert says so."""
    base = set(re.findall(r"mov\.b32\s+(%r\d+), global_smem;", ptx))
    off: dict[str, int] = {}
    for dst, src, const in re.findall(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);", ptx):
        if src in base:
            off[dst] = int(const)
    for dst, src in re.findall(r"cvt\.u64\.u32\s+(%rd\d+), (%r\d+);", ptx):
        if src in off:
            off[dst] = off[src]

    def resolve(reg: str) -> int:
        assert reg in off, f"{reg}: not a constant offset from global_smem"
        return off[reg]

    bars = {resolve(r) for r in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", ptx)}
    bars |= {int(n) for n in re.findall(r"mbarrier\.init\.shared::cta\.b64 \[global_smem\+(\d+)\]",
                                        ptx)}
    maps = {resolve(r) for r in re.findall(r"tensormap\.replace\.\S+ \[ (%rd\d+) \+ 0 \]", ptx)}
    return bars, maps


def _assert_map_template_clear_of_barriers(ptx: str) -> None:
    """A tensor map made on the device is built in a 128-byte shared-memory template that
    the allocator places on bytes it sees as dead. No initialised mbarrier may lie there:
    PTX makes writing an mbarrier's memory without mbarrier.inval undefined, and on the
    H200 a build whose template lay on its unused (yet initialised) ping-pong barriers
    faulted with "misaligned address" in the V copy through the map, with several CTAs
    an SM."""
    bars, maps = _barriers_and_map_templates(ptx)
    assert bars and maps
    for m in maps:
        assert m % 128 == 0
        inside = sorted(b for b in bars if m - 8 < b < m + 128)
        assert not inside, f"mbarriers at {inside} inside the tensor-map template at {m}"


@pytest.mark.parametrize("causal", C3_CASES)
def test_sm90_three_consumers(causal):
    """CONSUMERS=3 at head dim 64: three 4-warp consumer warpgroups (192 query rows) and the
    producer, 160 registers a consumer worker, wgmma and TMA, no spills, smem within sm_90's."""
    s = pg.settings_for(64, causal, CONSUMERS=3)
    k = _compile(64, causal, CONSUMERS=3)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]

    ws = re.findall(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: ([0-9, ]+)>", ttgir)
    assert len(ws) == 1, "expected exactly one ttg.warp_specialize op"
    assert [int(r) for r in ws[0].split(",")] == [s.CONSUMER_REGS, s.CONSUMER_REGS,
                                                  s.PRODUCER_REGS] == [160, 160, 24]
    # The default partition (consumer 0) plus three workers: consumers 1 and 2, producer.
    parts = re.findall(r"^\s*partition(\d+)\(.*num_warps\((\d+)\)", ttgir, re.M)
    assert [(int(i), int(w)) for i, w in parts] == [(0, 4), (1, 4), (2, 1)]
    assert k.metadata.num_warps == 16  # 3 consumer warpgroups + the producer padded to 4
    assert ttgir.count("ttng.warp_group_dot") >= 6  # QK^T and PV in each consumer

    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert ("inc", "160") in regs and ("dec", "24") in regs, regs
    # Triton gives the default partition (consumer 0) what the workers leave: 168.
    assert ("dec", "168") in regs, regs
    assert 128 * (168 + 2 * s.CONSUMER_REGS + s.PRODUCER_REGS) <= pg.REGISTER_FILE
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx)
    assert "cp.async.bulk.tensor" in ptx
    assert _ptxas_spill_bytes(ptx) == [0, 0]
    assert s.smem_bytes(64) <= k.metadata.shared <= pg.SMEM_LIMIT


def test_three_consumer_settings():
    s = pg.settings_for(64, True, CONSUMERS=3)
    assert (s.CONSUMERS, s.BLOCK_M, s.CONSUMER_REGS, s.UNROLL) == (3, 192, 160, False)
    assert pg.settings_for(64, CONSUMERS=3, UNROLL=True).UNROLL  # explicit overrides win
    assert s.smem_bytes(64) == 2 * 64 * (192 + 2 * 4 * 128) <= pg.SMEM_LIMIT
    # the defaults: three consumers at head dim 64 (ping-pong when not causal), two at 128
    assert (pg.settings_for(64).CONSUMERS, pg.settings_for(64).BLOCK_M) == (3, 192)
    assert pg.settings_for(64).PINGPONG and not pg.settings_for(64, True).PINGPONG
    assert (pg.settings_for(128).CONSUMERS, pg.settings_for(128).BLOCK_M) == (2, 128)
    two = pg.settings_for(64, False, CONSUMERS=2)  # the two-consumer kernel stays reachable
    assert (two.BLOCK_M, two.CONSUMER_REGS, two.UNROLL, two.PINGPONG) == (128, 240, True, False)
    with pytest.raises(ValueError, match=r"CONSUMERS=3 needs head_dim 64, got head_dim 128"):
        pg.settings_for(128, False, CONSUMERS=3)
    with pytest.raises(ValueError, match=r"CONSUMERS=4"):
        pg.settings_for(64, False, CONSUMERS=4)
    with pytest.raises(ValueError, match=r"BLOCK_M=128 must be 64 \* CONSUMERS=3"):
        pg.settings_for(64, False, CONSUMERS=3, BLOCK_M=128)
    with pytest.raises(ValueError, match=r"CONSUMER_REGS=168.*more than the 65536"):
        pg.settings_for(64, False, CONSUMERS=3, CONSUMER_REGS=168)
    with pytest.raises(ValueError, match=r"shared memory at head_dim 64"):
        pg.settings_for(64, False, CONSUMERS=3, STAGES=7)
    with pytest.raises(ValueError, match=r"CONSUMERS=3 needs head_dim 64"):  # explicit settings
        pg.compile_spec(head_dim=128, settings=pg.GluonSettings(CONSUMERS=3, BLOCK_M=192))


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_packed_p_has_no_half_swaps(head_dim, causal):
    """PACK_P (the default) converts P a register pair at a time: no PRMT left in SASS,
    where the one-cvt-a-value build has ptxas swap the halves of some pairs with PRMT."""
    packed = sass_listing(_compile(head_dim, causal).asm["cubin"])
    plain = sass_listing(_compile(head_dim, causal, PACK_P=False).asm["cubin"])
    assert "HGMMA" in packed and "PRMT" not in packed
    assert "PRMT" in plain


@pytest.mark.parametrize("consumers, block_m", [(2, 128), (3, 192)], ids=["c2", "c3"])
def test_launcher_grid_follows_block_m(monkeypatch, consumers, block_m):
    """The launch grid counts BLOCK_M-row tiles and the kernel gets the settings' CONSUMERS
    (recorded on CPU tensors with the kernel replaced; nothing runs)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    monkeypatch.setattr(pg, "attn_fwd_kernel", Recorder())
    q, k, v = _qkv(2, 300, 300, 4, 2, 64, torch.bfloat16)
    s = pg.settings_for(64, True, CONSUMERS=consumers)
    pg.prefill(q, k, v, True, 0.125, settings=s)
    (grid, kw), = launches
    assert grid == (-(-300 // block_m) * 2 * 4, )
    assert (kw["BLOCK_M"], kw["CONSUMERS"], kw["CONSUMER_REGS"]) == (block_m, consumers,
                                                                       s.CONSUMER_REGS)


class _Recorder:
    """Stands in for attn_fwd_kernel: records (grid, args, constexprs), runs nothing."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


def _pack(q_lens, kv_lens, Hq, Hkv, D, dtype, device="cpu", seed=0):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] and int32 cu_seqlens on device."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sum(q_lens), Hq, D, dtype=dtype, device=device, generator=g)
    k, v = (torch.randn(sum(kv_lens), Hkv, D, dtype=dtype, device=device, generator=g)
            for _ in range(2))
    cu = [torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
          for lens in (q_lens, kv_lens)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("max_q", [None, 300, 10 ** 6], ids=["omitted", "given", "above-Tq"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_varlen_launcher_grid_and_arguments(monkeypatch, head_dim, max_q):
    """prefill_varlen on the plain grid (compact_varlen=False) launches the VARLEN build
    over cdiv(max_q, BLOCK_M) row blocks per (sequence, head), max_q Tq when omitted and at
    most Tq; descriptors span the whole pack as [1, T, H * D]; the kernel gets the
    cu_seqlens, o's base, Tq and max_q (recorded on CPU tensors with the kernel replaced;
    nothing runs)."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    q, k, v, cu_q, cu_k = _pack([0, 300, 17, 5], [4, 310, 17, 9], 14, 2, head_dim,
                                torch.bfloat16)
    s = pg.settings_for(head_dim, True, compact_varlen=False)
    out, lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, True, 0.125, settings=s)
    (grid, args, kw), = rec.launches
    bound = 322 if max_q is None else min(max_q, 322)
    assert grid == (-(-bound // s.BLOCK_M) * 4 * 14, )
    (q_desc, k_desc, v_desc, o_desc, lse_arg, Sq, Sk, Hq, _, o_ptr, cu_q_arg, cu_k_arg, Tq, mq,
     n_bh, section, tiles, v_rows, block_table, bt_stride, bt_width, page_stride) = args
    assert (Sq, Sk, Hq, Tq, mq) == (0, 0, 14, 322, bound)  # Sq, Sk: fixed length only
    assert n_bh is None and section is None  # no persistent schedule for varlen
    assert tiles is None  # the plain grid: no tile table
    assert v_rows is v and kw["BOUNDED_V"]  # a partial last tile's V: the sequence's rows
    assert (block_table, bt_stride, bt_width, page_stride) == (None,) * 4 and "PAGE" not in kw
    assert list(q_desc.shape) == list(o_desc.shape) == [1, 322, 14 * head_dim]
    assert list(k_desc.shape) == list(v_desc.shape) == [1, 340, 2 * head_dim]
    assert list(q_desc.block_shape) == [1, 64, head_dim]
    assert list(k_desc.block_shape) == [1, s.BLOCK_N, head_dim]
    assert o_ptr is out and lse_arg is lse and cu_q_arg is cu_q and cu_k_arg is cu_k
    assert out.shape == (322, 14, head_dim) and lse.shape == (14, 322)
    assert lse.dtype == torch.float32
    assert kw["VARLEN"] is True and kw["GROUP"] == 7 and kw["CAUSAL"] is True
    assert (kw["BLOCK_M"], kw["CONSUMERS"]) == (s.BLOCK_M, s.CONSUMERS)


@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_varlen_launcher_takes_the_one_consumer_build_for_short_packs(monkeypatch, head_dim):
    """Without settings, prefill_varlen launches the one-consumer build (64-row tiles, the
    register cap of ONE_CONSUMER's CTAs an SM) where VARLEN_ONE_CONSUMER_UP_TO covers the
    pack's longest query and key sequences (max_seqlen_q / _k at most Tq / Tk, else those
    totals), the default
    build otherwise (recorded on CPU tensors with the kernel and the tile table's launch
    replaced; nothing runs)."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    monkeypatch.setattr(pg, "varlen_tile_table", lambda cu, n_tiles, *a, **kw:
                        torch.zeros(2, n_tiles, dtype=torch.int32))
    monkeypatch.setitem(pg.VARLEN_ONE_CONSUMER_UP_TO, (head_dim, True), 315)
    q, k, v, cu_q, cu_k = _pack([0, 300, 17, 5], [4, 310, 17, 9], 14, 2, head_dim,
                                torch.bfloat16)
    one = pg.settings_for(head_dim, True, **pg.ONE_CONSUMER[head_dim])
    default = pg.settings_for(head_dim, True)
    # Tq 322, Tk 340: the packed totals bound the omitted ones
    for max_q, max_k, want in ((300, 310, one), (None, 310, default), (300, None, default),
                               (300, 316, default), (316, 310, default)):
        pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, 0.125)
        _, _, kw = rec.launches[-1]
        assert (kw["CONSUMERS"], kw["BLOCK_M"], kw["BLOCK_N"], kw.get("maxnreg")) == (
            want.CONSUMERS, want.BLOCK_M, want.BLOCK_N, want.launch_options().get("maxnreg")), \
            (max_q, max_k)
    # Tq and Tk within the limit: omitted bounds, or bounds past them (clamped to them)
    monkeypatch.setitem(pg.VARLEN_ONE_CONSUMER_UP_TO, (head_dim, True), 340)
    for max_q, max_k in ((None, None), (10 ** 6, 10 ** 6)):
        pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, max_k, True, 0.125)
        assert rec.launches[-1][2]["CONSUMERS"] == 1


@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_launchers_take_the_one_consumer_build_for_short_chunks(monkeypatch, head_dim):
    """Without settings, a chunk of at most ONE_CONSUMER_CHUNK_UP_TO queries against keys
    past every length table takes the one-consumer build, with a mask or without:
    prefill_varlen, prefill_paged (reading the pages in place) and fixed-length prefill
    alike; a query more takes the default build, and so does a fixed-length chunk of 512
    (the fixed-length tables rank the longer of Sq and Sk). Recorded on CPU tensors with
    the kernel and the tile table's launch replaced; nothing runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    monkeypatch.setattr(pg, "varlen_tile_table", lambda cu, n_tiles, *a, **kw:
                        torch.zeros(2, n_tiles, dtype=torch.int32))
    chunk, keys = pg.ONE_CONSUMER_CHUNK_UP_TO, [4096, 2500]
    assert chunk == 64
    for q_len, causal, one in ((chunk, True, True), (1, True, True), (chunk + 1, True, False),
                               (chunk, False, True), (chunk + 1, False, False),
                               (512, True, False)):
        q, k, v, cu_q, cu_k = _pack([q_len, 3], keys, 4, 2, head_dim, torch.bfloat16)
        max_q = max(q_len, 3)  # the chunk bound the caller gives (else Tq bounds it)
        pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, 0.125)
        kc, vc, table, lens = _paged(k, v, keys, 64)
        pg.prefill_paged(q, kc, vc, cu_q, lens, table, max_q, causal, 0.125)
        pg.prefill(*_qkv(1, q_len, keys[0], 4, 2, head_dim, torch.bfloat16), causal, 0.125)
        got = [kw["CONSUMERS"] == 1 and kw["BLOCK_N"] == pg.ONE_CONSUMER[head_dim]["BLOCK_N"]
               for _, _, kw in rec.launches[-3:]]
        assert got == [one] * 3, (q_len, causal)
        assert pg.call_settings(head_dim, causal, q_len, keys[0]).CONSUMERS == (
            1 if one else pg.settings_for(head_dim, causal).CONSUMERS)
    # the same chunk against as many keys as queries keeps the short-shape table's build
    assert pg.call_settings(head_dim, True, 512, 512).CONSUMERS == 1
    assert pg.call_settings(head_dim, True, 512).CONSUMERS == 1


@pytest.mark.parametrize("max_q", [None, 300], ids=["omitted", "given"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compact_varlen_launcher_grid_and_table(monkeypatch, causal, max_q):
    """compact_varlen=True (the default): one table launch (cu_seqlens_q, Hq * tile_bound
    tiles, BLOCK_M, causal), then the kernel over exactly that many CTAs with the table and
    VARLEN = VARLEN_COMPACT; nothing read on the host (recorded with both kernels
    replaced). A fixed-length launch with the same settings takes no table; the
    longest-first setting reaches the table."""
    from wsattn.kernels import varlen_tiles as vt
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    tables = []

    def table(cu, n_tiles, hq, block_m, c, longest_first, cu_seqlens_k, key_counts=False):
        assert cu_seqlens_k is cu_k and not key_counts
        tables.append((cu, n_tiles, hq, block_m, c, longest_first))
        return torch.zeros(2, n_tiles, dtype=torch.int32)
    monkeypatch.setattr(pg, "varlen_tile_table", table)
    q, k, v, cu_q, cu_k = _pack([0, 300, 17, 5], [4, 310, 17, 9], 14, 2, 128, torch.bfloat16)
    s = pg.settings_for(128, causal)
    pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, 0.125, settings=s)
    (grid, args, kw), = rec.launches
    n = vt.tile_bound(322, 4, s.BLOCK_M, 322 if max_q is None else max_q) * 14
    assert tables == [(cu_q, n, 14, s.BLOCK_M, causal, True)] and grid == (n, )
    assert n < -(-(322 if max_q is None else max_q) // s.BLOCK_M) * 4 * 14  # fewer than plain
    assert args[16].shape == (2, n) and kw["VARLEN"] == pg.VARLEN_COMPACT
    assert args[17] is v and args[18:] == (None,) * 4 and kw["BOUNDED_V"]
    pg.prefill(q.view(1, 322, 14, 128), k[:322].view(1, 322, 2, 128),
               v[:322].view(1, 322, 2, 128), causal, 0.125, settings=s)
    assert len(tables) == 1 and not rec.launches[-1][2].get("VARLEN")
    # varlen_longest_first=False asks the table for the pack's order, nothing else moves
    pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, 0.125,
                      settings=pg.settings_for(128, causal, varlen_longest_first=False))
    assert tables[-1] == (cu_q, n, 14, s.BLOCK_M, causal, False)
    assert rec.launches[-1][0] == (n, ) and rec.launches[-1][2]["VARLEN"] == pg.VARLEN_COMPACT
    # varlen_bounded_v=False passes no v base (no device-made descriptor), nothing else moves
    pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, 0.125,
                      settings=pg.settings_for(128, causal, varlen_bounded_v=False))
    (grid_b, args_b, kw_b) = rec.launches[-1]
    assert grid_b == (n, ) and not kw_b["BOUNDED_V"]
    assert args_b[17:] == (None,) * 5
    assert [a for a in args_b[:17] if not hasattr(a, "shape")] == \
        [a for a in args[:17] if not hasattr(a, "shape")]


def _paged(k, v, kv_lens, page, seed=0):
    """k, v packed [Tk, Hkv, D] -> (k_cache, v_cache [num_pages, page, Hkv, D], int32
    block table [batch, width], int32 seqlens): each sequence's pages a random permutation
    of the cache's, every row no key owns NaN, table entries past a sequence's pages -1 (a
    kernel reading one fails)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page) for n in kv_lens]
    total, width = sum(n_pages) + 3, max(max(n_pages), 1) + 2
    perm = torch.randperm(total, generator=g).tolist()
    kc = torch.full((total, page) + tuple(k.shape[1:]), float("nan"), dtype=k.dtype,
                    device=k.device)
    vc = torch.full_like(kc, float("nan"))
    table = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    start, used = 0, 0
    for b, n in enumerate(kv_lens):
        for i in range(n_pages[b]):
            pid = perm[used]
            used += 1
            table[b, i] = pid
            rows = min(page, n - i * page)
            kc[pid, :rows] = k[start + i * page:start + i * page + rows]
            vc[pid, :rows] = v[start + i * page:start + i * page + rows]
        start += n
    return kc, vc, table.to(k.device), torch.tensor(kv_lens, dtype=torch.int32, device=k.device)


@pytest.mark.parametrize("page", [16, 256])
def test_paged_launcher_grid_and_arguments(monkeypatch, page):
    """prefill_paged launches the varlen build's grid over the same tile table (keys counted
    by seqlens_k itself: the table and the kernel take counts, no prefix sum, no host
    read) with PAGE, k/v descriptors over the cache
    as [num_pages, page, Hkv * D] in min(page, BLOCK_N)-row boxes, the block table, its row
    stride, the V cache and its page stride (recorded on CPU tensors; nothing runs);
    refuses a page size it does not take and pages whose rows are not packed."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    tables = []

    def table_of(cu, n_tiles, hq, block_m, c, longest_first, cu_seqlens_k, key_counts=False):
        tables.append((cu, n_tiles, longest_first, cu_seqlens_k, key_counts))
        return torch.full((2, n_tiles), len(tables), dtype=torch.int32)
    monkeypatch.setattr(pg, "varlen_tile_table", table_of)
    kv_lens = [4, 310, 17, 9]
    q, k, v, cu_q, cu_k = _pack([0, 300, 17, 5], kv_lens, 14, 2, 128, torch.bfloat16)
    kc, vc, table, lens = _paged(k, v, kv_lens, page)
    s = pg.settings_for(128, True)
    pg.prefill_paged(q, kc, vc, cu_q, lens, table, None, True, 0.125, settings=s)
    pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, True, 0.125, settings=s)
    (grid, args, kw), (vgrid, vargs, vkw) = rec.launches
    assert grid == vgrid and kw["PAGE"] == page and vkw.get("PAGE", 0) == 0
    # the same table request, the paged one with the key counts themselves
    assert [t[:3] for t in tables] == [(cu_q, grid[0], True)] * 2
    assert tables[0][3] is lens and tables[0][4] and tables[1][3] is cu_k and not tables[1][4]
    assert args[11] is lens and vargs[11] is cu_k and args[16][0, 0] == 1
    assert args[17] is vc and args[18] is table
    assert args[19:] == (table.stride(0), table.shape[1], vc.stride(0))
    box = min(page, s.BLOCK_N)
    for d in args[1:3]:
        assert list(d.shape) == [kc.shape[0], page, 2 * 128]
        assert list(d.block_shape) == [1, box, 128]
    # the kernel reads seqlens_k by index: a strided view reaches it as a packed copy
    every_other = torch.stack([lens, torch.full_like(lens, -1)], 1)[:, 0]
    pg.prefill_paged(q, kc, vc, cu_q, every_other, table, None, True, 0.125, settings=s)
    passed = rec.launches[-1][1][11]
    assert passed.is_contiguous() and torch.equal(passed, lens) and tables[-1][3] is passed
    with pytest.raises(ValueError, match="page sizes"):
        pg.prefill_paged(q, kc[:, :12], vc[:, :12], cu_q, lens, table, None, True, 0.125)
    strided = torch.empty(kc.shape[0], page, 2, 256, dtype=kc.dtype)[..., :128]
    with pytest.raises(ValueError, match="k_cache: each page's rows must be contiguous"):
        pg.prefill_paged(q, strided, vc, cu_q, lens, table, None, True, 0.125)


def test_varlen_launcher_copies_what_tma_cannot_describe(monkeypatch):
    """A q whose heads are not packed next to D (a transposed view) is copied before its
    [1, T, H * D] descriptor is made, not described wrongly."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    q, k, v, cu_q, cu_k = _pack([5, 7], [5, 7], 4, 2, 64, torch.float16)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] view of [H, T, D]
    assert not pg.tma_ready(q_t.unsqueeze(0))
    pg.prefill_varlen(q_t, k, v, cu_q, cu_k, None, None, False, 0.125,
                      settings=pg.settings_for(64, False, compact_varlen=False))
    (_, args, _), = rec.launches
    assert list(args[0].shape) == [1, 12, 4 * 64] and args[0].base.is_contiguous()
    assert torch.equal(args[0].base.view(12, 4, 64), q)


def test_varlen_no_work_launches_nothing(monkeypatch):
    """No queries, no sequences or max_seqlen_q 0: nothing to launch; no keys anywhere
    (Tk = 0, no TMA descriptor can span it): out 0 and lse -inf, as the reference gives,
    without a kernel."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    q, k, v, cu_q, cu_k = _pack([3, 0, 2], [0, 0, 0], 4, 2, 128, torch.bfloat16)
    out, lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, False, 0.125)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full((4, 5), float("-inf")))
    from wsattn import reference
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, False)
    assert torch.equal(out.double(), ref) and torch.equal(lse.double(), ref_lse)
    q0, k0, v0, cu_q0, cu_k0 = _pack([0, 0], [3, 4], 4, 2, 64, torch.float16)
    out0, lse0 = pg.prefill_varlen(q0, k0, v0, cu_q0, cu_k0, None, None, True, 0.125)
    assert out0.shape == (0, 4, 64) and lse0.shape == (4, 0)
    q1, k1, v1, cu_q1, cu_k1 = _pack([3], [4], 4, 2, 64, torch.float16)
    pg.prefill_varlen(q1, k1, v1, cu_q1, cu_k1, 0, None, True, 0.125)
    pg.prefill_varlen(q1, k1, v1, cu_q1[:1], cu_k1[:1], None, None, True, 0.125)
    assert rec.launches == []


def test_varlen_dispatch_accepts_gluon_and_auto_ranks_by_the_longest_sequence():
    """impl="gluon" qualifies varlen prefill on sm_90 (no kv_len check: rows with no key get
    0 and -inf); the paged prefill where it can box the pages; impl="auto" ranks varlen as fixed-length
    prefill, on the longest sequence."""
    from wsattn import dispatch
    dev = torch.device("cuda", 0)
    call = dispatch.Call("prefill_varlen", dev, torch.bfloat16, 128, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pg, "_cc", lambda device: 90)  # an sm_90 device, without one
        assert dispatch.reason("gluon", call) is None
        assert dispatch.reason("gluon", dispatch.Call("prefill_varlen", dev, torch.float16,
                                                      64)) is None
        assert "head dim 64 or 128" in dispatch.reason(
            "gluon", dispatch.Call("prefill_varlen", dev, torch.bfloat16, 256))
        assert "float16 or bfloat16" in dispatch.reason(
            "gluon", dispatch.Call("prefill_varlen", dev, torch.float32, 128))
        assert "page_size 0" in dispatch.reason(
            "gluon", dispatch.Call("prefill_paged", dev, torch.bfloat16, 128))
        assert dispatch.reason("gluon", dispatch.Call(
            "prefill_paged", dev, torch.bfloat16, 128, page_size=64, tma_pages=True)) is None
        assert "kv_len > 0" in dispatch.reason(
            "gluon", dispatch.Call("prefill", dev, torch.bfloat16, 128, False, 4, 0))
        assert dispatch.resolve("gluon", call) == "gluon"
        # lengths 0: a pack of short sequences, the one-consumer build
        assert dispatch.ranking(call) == ("gluon", "triton")
        assert dispatch.resolve("auto", call) == "gluon"
        long = dispatch.Call("prefill_varlen", dev, torch.bfloat16, 128, True, 4096, 4096)
        assert dispatch.resolve("auto", long) == "gluon"
        # short queries against long keys: Gluon if causal (the length table has no causal
        # entry), the length table without a mask (Triton up to its limit at D64)
        for q_len in (1, 255, 512):
            chunk = dispatch.Call("prefill_varlen", dev, torch.bfloat16, 128, True, q_len, 8192)
            assert dispatch.resolve("auto", chunk) == "gluon"
        chunk = dispatch.Call("prefill_varlen", dev, torch.bfloat16, 64, False, 255, 8192)
        assert dispatch.resolve("auto", chunk) == "triton"


def test_ladder_varlen_entry_builds_and_runs_the_varlen_launcher(monkeypatch):
    """`prefill_gluon_varlen` on the evidence ladder: gates 0-2 on sm_90 with no GPU (the
    VARLEN build with its tile table, the default; warp-specialized), and its run hands packed inputs to prefill_varlen
    through the API, not to the fixed-length launcher (recorded; nothing runs)."""
    from wsattn.evidence import ladder, library
    spec = library.get("prefill_gluon_varlen")
    assert not spec.unavailable, spec.unavailable
    assert spec.compile_spec(90)["constexprs"]["VARLEN"] == pg.VARLEN_COMPACT
    r = ladder.climb(spec, "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2, r.verdict
    calls = []
    monkeypatch.setattr(pg, "device_supported", lambda device: True)
    monkeypatch.setattr(pg, "prefill", lambda *a, **kw: calls.append("fixed"))

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, settings=None):
        calls.append(("varlen", q.shape, cu_q.tolist(), max_q, causal))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    monkeypatch.setattr(pg, "prefill_varlen", varlen)
    import random
    inp = spec.run.build({"Sq": [17, 1], "Sk": [40, 1], "Hq": 4, "Hkv": 2, "D": 64}, "bf16",
                         "cpu", torch.Generator().manual_seed(0))
    out, lse = spec.run.run(inp)
    assert calls == [("varlen", (18, 4, 64), [0, 17, 18], 18, False)]
    assert out.shape == (18, 4, 64) and lse.shape == (4, 18)
    assert spec.run.draw_shape(random.Random(0), False)["D"] == 128
    # the sanitizer's short packs launch the one-consumer build through the API, its
    # longer ones (1,100 tokens) the default builds: the racecheck waiver reads each one's
    # dispatch bytes
    builds = [b for sh in spec.run.sanitizer_shapes for b in spec.run.sanitizer_builds(sh)]
    assert [(b["head_dim"], b["settings"].CONSUMERS) for b in builds] == [
        (128, 1), (64, 1), (128, 2), (64, 3)]
    assert spec.run.sanitizer_builds({"Sq": [4000], "Sk": [4000], "D": 128})[0][
        "settings"] == pg.settings_for(128, False)


VARLEN_ENTRIES = ("prefill_triton_varlen", "prefill_gluon_varlen", "prefill_gluon_varlen_plain",
                  "prefill_gluon_varlen_one_consumer")


def test_ladder_varlen_entries_profile_against_fa2_on_a_mixed_pack():
    """The varlen entries' profile gate (gate 7) times each against torch's FlashAttention-2
    varlen call on one pack: 16,384 tokens of mixed lengths (1 to 8,192, and 63), or for the
    one-consumer build the packs of short sequences it is chosen for; the pack's inputs
    carry the host integers FA2 needs, and a long pack's label stays one line."""
    from wsattn.evidence import library
    for name in VARLEN_ENTRIES:
        run = library.get(name).run
        assert run.baseline is not None and "FlashAttention-2 varlen" in run.baseline_name
        (shape,) = run.profile_shapes
        assert shape["Sq"] == shape["Sk"] and shape["D"] == 128
        lens = shape["Sq"]
        if name.endswith("one_consumer"):
            assert max(lens) <= pg.VARLEN_ONE_CONSUMER_UP_TO[128, True] and len(lens) == 32
            assert run.describe(shape) == ("Sq32seqs12280tok17to1024-Sk32seqs12280tok17to1024"
                                           "-H16-HKV16-D128")
        else:
            assert sum(lens) == 16384 and max(lens) == 8192 and 63 in lens and 1 in lens
            assert run.describe(shape).startswith("Sq8192+4096+")
    inp = library.get("prefill_gluon_varlen").run.build(
        {"Sq": [17, 1], "Sk": [40, 3], "Hq": 4, "Hkv": 2, "D": 64}, "bf16", "cpu",
        torch.Generator().manual_seed(0))
    assert (inp["max_q"], inp["max_k"]) == (17, 40) and inp["cu_k"].tolist() == [0, 40, 43]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ladder_varlen_baseline_agrees_with_the_reference(causal):
    """The FA2 baseline the varlen entries are profiled against computes the same attention
    (bottom-right causal, GQA, odd lengths, keys longer than queries) within bf16 tolerance
    of the float64 reference, so the profile gate times a peer doing the same work."""
    from wsattn.evidence import library
    name = "prefill_gluon_varlen_one_consumer" if causal else "prefill_triton_varlen"
    run = library.get(name).run
    for shape in ({"Sq": [17, 1, 300], "Sk": [40, 1, 323], "Hq": 8, "Hkv": 2, "D": 128},
                  {"Sq": [65, 63], "Sk": [65, 100], "Hq": 7, "Hkv": 1, "D": 64}):
        inp = run.build(shape, "bf16", "cuda", torch.Generator().manual_seed(3))
        ref, _ = run.reference(inp)
        assert_close(run.baseline(inp), ref, torch.bfloat16)


def test_ladder_varlen_entries_build_the_table_grid_and_the_plain_one(monkeypatch):
    """`prefill_gluon_varlen` gates 0-2 on the VARLEN_COMPACT build (the default; tiles an
    argument), `prefill_gluon_varlen_plain` on the plain grid's; the latter's runner calls
    prefill_varlen with compact_varlen=False (recorded; nothing runs)."""
    from wsattn.evidence import ladder, library
    cs = library.get("prefill_gluon_varlen").compile_spec(90)
    assert cs["constexprs"]["VARLEN"] == pg.VARLEN_COMPACT and cs["signature"]["tiles"] == "*i32"
    spec = library.get("prefill_gluon_varlen_plain")
    assert not spec.unavailable, spec.unavailable
    cs = spec.compile_spec(90)
    assert cs["constexprs"]["VARLEN"] is True and cs["constexprs"]["tiles"] is None
    assert spec.compile_spec(90, head_dim=64)["constexprs"]["VARLEN"] is True
    r = ladder.climb(spec, "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2, r.verdict
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, settings=None):
        calls.append((q.shape, cu_q.tolist(), settings.compact_varlen, causal))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    monkeypatch.setattr(pg, "prefill_varlen", varlen)
    inp = spec.run.build({"Sq": [17, 1], "Sk": [40, 1], "Hq": 4, "Hkv": 2, "D": 64}, "bf16",
                         "cpu", torch.Generator().manual_seed(0))
    out, lse = spec.run.run(inp)
    assert calls == [((18, 4, 64), [0, 17, 18], False, False)]


def test_ladder_one_consumer_varlen_entry(monkeypatch):
    """`prefill_gluon_varlen_one_consumer` gates 0-2 on the one-consumer varlen build (the
    launch's register cap, 64-row tiles); its runner calls prefill_varlen with ONE_CONSUMER
    of the shape's head dim, and its sanitizer builds are those, one a head dim (recorded;
    nothing runs)."""
    from wsattn.evidence import ladder, library
    spec = library.get("prefill_gluon_varlen_one_consumer")
    assert not spec.unavailable, spec.unavailable
    cs = spec.compile_spec(90)
    assert cs["constexprs"]["CONSUMERS"] == 1 and cs["constexprs"]["BLOCK_M"] == 64
    assert cs["constexprs"]["VARLEN"] == pg.VARLEN_COMPACT and cs["constexprs"]["CAUSAL"]
    assert cs["options"]["maxnreg"] == 128
    r = ladder.climb(spec, "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2, r.verdict
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, settings=None):
        calls.append((q.shape[-1], settings.CONSUMERS, settings.ctas_per_sm, causal))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    monkeypatch.setattr(pg, "prefill_varlen", varlen)
    for D in (64, 128):
        inp = spec.run.build({"Sq": [17, 1], "Sk": [40, 1], "Hq": 4, "Hkv": 2, "D": D}, "bf16",
                             "cpu", torch.Generator().manual_seed(0))
        spec.run.run(inp)
    assert calls == [(64, 1, 3, True), (128, 1, 2, True)]
    builds = [b for sh in spec.run.sanitizer_shapes for b in spec.run.sanitizer_builds(sh)]
    assert sorted((b["head_dim"], b["settings"].ctas_per_sm) for b in builds) == [(64, 3),
                                                                                (128, 2)]


@pytest.mark.parametrize("one", [False, True], ids=["picked", "one_consumer"])
def test_ladder_gluon_paged_entries(monkeypatch, one):
    """`prefill_gluon_paged` (the build the launcher picks) and
    `prefill_gluon_paged_one_consumer` (ONE_CONSUMER whatever the shape) gates 0-2 on their
    paged builds (pages of 16); their runners call prefill_paged without settings / with
    ONE_CONSUMER of the shape's head dim, and their sanitizer builds are what those calls
    launch: the one-consumer build at both head dims for the short chunks, and for the
    picked entry the default build for the 65-query chunk over 1,000 keys (recorded;
    nothing runs)."""
    from wsattn.evidence import ladder, library
    spec = library.get("prefill_gluon_paged_one_consumer" if one else "prefill_gluon_paged")
    assert not spec.unavailable, spec.unavailable
    cs = spec.compile_spec(90)
    assert cs["constexprs"]["PAGE"] == 16 and cs["constexprs"]["CAUSAL"]
    assert cs["constexprs"]["CONSUMERS"] == (1 if one else 2)
    assert ("maxnreg" in cs["options"]) == one
    r = ladder.climb(spec, "sm_90", ladder.Config(max_gate=2))
    assert r.highest_gate == 2, r.verdict
    calls = []

    def paged(q, kc, vc, cu_q, lens, table, max_q, causal, sm_scale, settings=None):
        calls.append((q.shape[-1], None if settings is None else settings.CONSUMERS, causal))
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])
    monkeypatch.setattr(pg, "prefill_paged", paged)
    for D in (64, 128):
        inp = spec.run.build({"Lq": [17, 1], "P": [23, 0], "Hq": 4, "Hkv": 2, "D": D,
                              "page": 16}, "bf16", "cpu", torch.Generator().manual_seed(0))
        spec.run.run(inp)
    assert calls == [(64, 1 if one else None, True), (128, 1 if one else None, True)]
    shapes = spec.run.sanitizer_shapes
    builds = [(b["head_dim"], b["page"], b["settings"].CONSUMERS)
              for sh in shapes for b in spec.run.sanitizer_builds(sh)]
    assert builds == [(128, 16, 1), (64, 64, 1), (128, 16, 1 if one else 2)]


def test_api_refuses_gluon_varlen_off_sm90(monkeypatch):
    """With the interpreter on, CPU tensors get past the device check to check_device."""
    import wsattn
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, cu_q, cu_k = _pack([3, 5], [3, 5], 2, 1, 64, torch.float16)
    with pytest.raises(ValueError, match=r"sm_90 \(Hopper\) only, not on CPU tensors"):
        wsattn.attention_varlen(q, k, v, cu_q, cu_k, impl="gluon")


def test_api_qualifies_the_same_calls():
    """CONSUMERS is a settings option only: the default settings build for every head dim
    and the qualification rules accept the same fp16/bf16 D=64/128 calls as before."""
    for d in pg.GLUON_HEAD_DIMS:
        for dtype in pg.GLUON_DTYPES:
            q, k, v = _qkv(1, 5, 7, 4, 2, d, dtype)
            for causal in (False, True):
                assert pg.unsupported_reason(q, k, v, causal, varlen=False) is None
                pg.settings_for(d, causal).check(d)


def _qkv(B, Sq, Sk, Hq, Hkv, D, dtype, device="cpu"):
    g = torch.Generator(device=device).manual_seed(B * 1000 + Sq + Sk + Hq + D)
    return tuple(torch.randn(B, S, H, D, dtype=dtype, device=device, generator=g)
                 for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv)))


def test_tma_views_need_packed_heads_and_alignment():
    """Inputs the [B, S, H * D] TMA view cannot describe are copied, not rejected."""
    x = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    assert pg.tma_ready(x) and pg.tma_ready(x[:, 1:])
    assert not pg.tma_ready(x.transpose(1, 2))  # heads not packed next to D
    flat = torch.randn(2 * 5 * 4 * 64 + 1, dtype=torch.bfloat16)
    assert not pg.tma_ready(flat[1:].view(2, 5, 4, 64))  # base off 16-byte alignment


def test_unsupported_reason():
    q, k, v = _qkv(1, 4, 4, 2, 1, 64, torch.float16)
    assert pg.unsupported_reason(q, k, v, False, varlen=False) is None
    tq, tk, tv = (t[0] for t in (q, k, v))  # packed [T, H, D]
    assert pg.unsupported_reason(tq, tk, tv, True, varlen=True) is None
    assert pg.unsupported_reason(tq, tk[:0], tv[:0], False, varlen=True) is None  # no keys: 0, -inf
    fp32 = (q.float(), k.float(), v.float())
    assert "float16 or bfloat16" in pg.unsupported_reason(*fp32, False, varlen=False)
    q2, k2, v2 = _qkv(1, 4, 4, 2, 1, 256, torch.float16)
    assert "head dim" in pg.unsupported_reason(q2, k2, v2, False, False)
    q3, k3, v3 = _qkv(1, 4, 0, 2, 1, 64, torch.float16)
    assert "kv_len" in pg.unsupported_reason(q3, k3, v3, False, False)


def test_check_device_names_the_target():
    assert not pg.device_supported(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"sm_90.*impl='triton'"):
        pg.check_device(torch.device("cpu"))


def test_api_refuses_gluon_off_sm90(monkeypatch):
    """With the interpreter on, CPU tensors get past the device check to check_device."""
    import wsattn
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v = _qkv(1, 4, 4, 2, 1, 64, torch.float16)
    with pytest.raises(ValueError, match=r"sm_90 \(Hopper\) only, not on CPU tensors"):
        wsattn.attention(q, k, v, impl="gluon")


# --------------------------------------------------------------------------- persistent

def _ptx_opcode_counts(ptx: str) -> dict[str, int]:
    """Instruction counts of a PTX listing by opcode (with its type suffixes; a predicate
    guard is not part of it), directives, labels and braces left out."""
    counts: dict[str, int] = {}
    for line in ptx.splitlines():
        line = line.strip()
        if not line or line.startswith(("//", ".", "{", "}", "$")):
            continue
        m = re.match(r"(?:@!?%p\d+\s+)?([a-z][\w.]*)", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# The default builds' PTX: (instructions, sha256 of the sorted opcode counts), Triton 3.6.
# persistent=False must compile the persistent schedule's code away; a change to the
# default builds updates these knowingly (the last: builds without ping-pong turns no
# longer initialise the turn barriers, 2-3 mbarrier.init fewer).
DEFAULT_PTX = {(64, False, False): (7161, "94cd0a5a28337370"),
               (64, True, False): (5824, "e0f196f64e1fcfe1"),
               (128, False, False): (7249, "0c25d3dec0cf8e34"),
               (128, True, False): (5650, "a760815bd3008db4"),
               (64, False, True): (7996, "a709d12c1aaf8d32"),
               (64, True, True): (6657, "eb3cfd51ffba39db"),
               (128, False, True): (8197, "47d1aa92f314dc83"),
               (128, True, True): (6473, "c6578eda0fe204bb")}


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_default_builds_unchanged_by_persistent(head_dim, causal, varlen):
    """The non-persistent builds' PTX (varlen: the plain grid's) has the instruction counts,
    opcode by opcode, pinned in DEFAULT_PTX: the persistent schedule's code compiles away."""
    import hashlib
    import json
    counts = _ptx_opcode_counts(_compile(head_dim, causal, varlen, compact_varlen=False,
                                         varlen_bounded_v=False).asm["ptx"])
    digest = hashlib.sha256(json.dumps(sorted(counts.items())).encode()).hexdigest()[:16]
    assert (sum(counts.values()), digest) == DEFAULT_PTX[head_dim, causal, varlen], counts


# ptxas -v spill bytes (stores, loads) of the persistent builds. D64 causal: two registers
# of each consumer are stored and reloaded around each tile's masked first tile (SASS: two
# STL before its QK^T, two LDL.LU in its mask), once per query tile, none in the key loop.
PERSISTENT_SPILL_BYTES = {(64, True): 24}


@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_persistent_structure(head_dim, causal):
    """persistent=True (D64 three consumers, D128 two; causal and not): the same partitions,
    warps and registers as the default build, a tile loop bounded by the grid size
    (%nctaid), the schedule's arguments, and no spills but the per-tile ones recorded."""
    s = pg.settings_for(head_dim, causal, persistent=True)
    assert s.persistent and not s.UNROLL  # PER_PERSISTENT: UNROLL spills with the tile loop
    k = _compile(head_dim, causal, persistent=True)
    _assert_ws_structure(k, s, head_dim)
    ptx = k.asm["ptx"]
    assert "%nctaid.x" in ptx, "the CTAs stride over the tiles by the grid size"
    assert "%nctaid.x" not in _compile(head_dim, causal).asm["ptx"]
    spill = PERSISTENT_SPILL_BYTES.get((head_dim, causal), 0)
    assert _ptxas_spill_bytes(ptx) == [spill, spill]
    assert k.metadata.shared <= pg.SMEM_LIMIT
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, settings=s)
    assert spec["signature"]["n_bh"] == spec["signature"]["section"] == "i32"
    assert spec["constexprs"]["PERSISTENT"] is True


def _py_twin(fn, pid=0, grid=1, memory=None):
    """The Python function under a @gluon.jit helper, run with plain integers: `gl` is
    replaced by the few integer operations the schedule uses, the jit helpers it calls by
    their own twins, pointers by integer addresses into `memory` (a dict). The kernel's own
    index arithmetic, not a copy of it."""
    import types
    shim = types.SimpleNamespace(minimum=min, maximum=max, cdiv=lambda a, b: -(-a // b),
                                 program_id=lambda axis: pid, num_programs=lambda axis: grid,
                                 constexpr=object, load=lambda addr: memory[addr],
                                 where=lambda c, a, b: a if c else b)
    glb = dict(fn.fn.__globals__, gl=shim)
    from triton.experimental.gluon import language as gl
    for name in fn.fn.__code__.co_names:
        if hasattr(glb.get(name), "fn"):  # a jit function it calls
            glb[name] = _py_twin(glb[name], pid, grid, memory)
        elif isinstance(glb.get(name), gl.constexpr):  # a module constant: its value
            glb[name] = glb[name].value
    return types.FunctionType(fn.fn.__code__, glb, fn.fn.__name__, fn.fn.__defaults__)


def _walk(B, Sq, Sk, Hq, group, grid, section, block_m, block_n, causal):
    """Each CTA's tiles [(t, start_m, b, h, n_total)], from the twins of the kernel's
    _persistent_walk and _persistent_tile (the helpers the producer and the consumers call)."""
    from wsattn.kernels import prefill_gluon_parts as parts
    n_m = -(-Sq // block_m)
    walks = []
    for pid in range(grid):
        first, stride, count = _py_twin(parts._persistent_walk, pid, grid)(n_m * B * Hq)
        tile = _py_twin(parts._persistent_tile, pid, grid)
        walk = []
        for t in (first + i * stride for i in range(count)):
            m, b, h, _, n_total = tile(t, n_m, B * Hq, section, Sq, Sk, Hq, block_m, block_n,
                                       causal)
            walk.append((t, m, b, h, n_total))
        walks.append(walk)
    return walks


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compact_tile_reads_the_table_as_the_plain_grid_tiles(causal):
    """The twin of the kernel's _tile with VARLEN == COMPACT, over a table from the Python
    enumeration of tests/test_varlen_tiles.py: the real CTAs get exactly the plain grid's
    live (sequence, head, row block) tiles with their rows and key counts, each once; the
    spares get q_len 0, which the kernel's prologue exits on. The paged build (PAGE) reads
    the same tiles with each sequence's key count from seqlens_k and k0 = 0."""
    from test_varlen_tiles import reference

    from wsattn.kernels import prefill_gluon_parts as parts
    from wsattn.kernels import varlen_tiles as vt
    q_lens, kv_lens, hq, bm, bn = [0, 300, 17, 5, 129], [4, 310, 17, 9, 200], 3, 128, 64
    cu_q = [0] + list(itertools.accumulate(q_lens))
    cu_k = [0] + list(itertools.accumulate(kv_lens))
    n = hq * vt.tile_bound(sum(q_lens), len(q_lens), bm, max(q_lens))
    seqs, codes = reference(q_lens, hq, bm, causal, n)
    CU_Q, CU_K, LENS_K, TILES = 0, 100, 200, 1000  # addresses in the twin's memory
    memory = {**{CU_Q + i: x for i, x in enumerate(cu_q)},
              **{CU_K + i: x for i, x in enumerate(cu_k)},
              **{LENS_K + i: x for i, x in enumerate(kv_lens)},
              **{TILES + i: x for i, x in enumerate(seqs + codes)}}
    compact, plain = [], []
    for pid in range(n):
        tile = _py_twin(parts._tile, pid, n, memory)
        m, off_b, h, q0, k0, q_len, kv_len = tile(pid, None, 0, 0, hq, CU_Q, CU_K, TILES,
                                                  causal, parts.VARLEN_COMPACT)
        assert off_b == 0
        paged = tile(pid, None, 0, 0, hq, CU_Q, LENS_K, TILES, causal, parts.VARLEN_COMPACT,
                     64)
        assert paged == (m, 0, h, q0, 0, q_len, kv_len)
        if m * bm < q_len:
            compact.append((q0, h, m, k0, q_len, kv_len,
                            _py_twin(parts._tile_counts)(m, q_len, kv_len, bm, bn, causal)))
        else:  # a spare: the table says so, the prologue sees no rows
            assert (m, q_len, seqs[pid]) == (0, 0, -1), pid
    n_m = -(-max(q_lens) // bm)
    grid = n_m * len(q_lens) * hq
    for pid in range(grid):
        tile = _py_twin(parts._tile, pid, grid, memory)
        m, off_b, h, q0, k0, q_len, kv_len = tile(pid, n_m, 0, 0, hq, CU_Q, CU_K, None,
                                                  causal, True)
        if m * bm < q_len:
            plain.append((q0, h, m, k0, q_len, kv_len,
                          _py_twin(parts._tile_counts)(m, q_len, kv_len, bm, bn, causal)))
    assert compact == plain and len(set(compact)) == len(compact)
    assert len(compact) == hq * sum(-(-x // bm) for x in q_lens) < grid


WALK_CASES = [  # B, Sq, Sk, Hq, GROUP, grid, section, BLOCK_M: tails of every kind
    (1, 1, 1, 1, 1, 132, 1, 128),
    (2, 1000, 1000, 8, 4, 132, 16, 128),
    (3, 777, 777, 32, 4, 132, 20, 192),     # 96 pairs: 4 sections of 20 and one of 16
    (2, 65, 300, 6, 3, 7, 9, 128),          # q_len < kv_len; 12 pairs: sections of 9 and 3
    (4, 8191, 8191, 4, 1, 132, 3, 192),     # 16 pairs: 5 sections of 3 and one of 1
    (1, 193, 193, 14, 7, 5, 14, 192),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", WALK_CASES, ids=["-".join(map(str, c)) for c in WALK_CASES])
def test_persistent_schedule_visits_every_tile_once(case, causal):
    """Across all CTAs every (row block, batch, head) tile is taken exactly once; each
    tile's key-tile count is the number of key tiles its rows see (counted from the mask);
    causal tiles come longest first within a section, per CTA as well; consecutive tiles
    share a KV head (GQA group) within a row block of a section."""
    B, Sq, Sk, Hq, group, grid, section, block_m = case
    block_n = 128
    assert Hq % group == 0 and section % group == 0  # as l2_section makes them
    walks = _walk(B, Sq, Sk, Hq, group, grid, section, block_m, block_n, causal)
    n_m = -(-Sq // block_m)
    taken = [(m, b, h) for walk in walks for _, m, b, h, _ in walk]
    assert sorted(taken) == [(m, b, h) for m in range(n_m) for b in range(B) for h in range(Hq)]
    for walk in walks:
        for t, m, b, h, n_total in walk:
            last_row = min(Sq, (m + 1) * block_m) - 1
            seen = Sk if not causal else min(Sk, last_row + Sk - Sq + 1)  # keys of the last row
            assert n_total == -(-seen // block_n), (t, m, b, h)
    order = sorted(tile for walk in walks for tile in walk)  # by t
    assert [t for t, *_ in order] == list(range(n_m * B * Hq))
    for (t0, m0, b0, h0, n0), (t1, m1, b1, h1, n1) in zip(order, order[1:]):
        if t0 // (section * n_m) != t1 // (section * n_m):
            continue  # the next section starts
        if causal:
            assert n1 <= n0 and m1 <= m0, "longest first within a section"
        else:
            assert m1 >= m0
        if m1 == m0:  # same row block: (batch, head) pairs in order, so a GQA group's
            # heads (GROUP consecutive h, never split by a section) are consecutive tiles
            assert (b1 * Hq + h1) == (b0 * Hq + h0) + 1
    if causal:
        for walk in walks:
            per_sec = {}
            for t, m, b, h, n in walk:
                per_sec.setdefault(t // (section * n_m), []).append(n)
            assert all(ns == sorted(ns, reverse=True) for ns in per_sec.values())


def test_persistent_partitions_share_one_schedule():
    """The producer and the consumers read their persistent tiles from the same two
    helpers, and nothing else maps a tile index in that branch, so their orders are the
    same by construction (each call site's source, parsed)."""
    import ast
    import inspect
    from wsattn.kernels import prefill_gluon_parts as parts

    def persistent_calls(fn):
        tree = ast.parse(inspect.getsource(fn.fn))
        branch = next(n for n in ast.walk(tree)
                      if isinstance(n, ast.If) and getattr(n.test, "id", None) == "PERSISTENT")
        return sorted(c.func.id for stmt in branch.body for c in ast.walk(stmt)
                      if isinstance(c, ast.Call) and isinstance(c.func, ast.Name))

    consumer, producer = persistent_calls(parts._consumer), persistent_calls(parts._producer)
    for calls in (consumer, producer):
        assert calls.count("_persistent_walk") == 1 and calls.count("_persistent_tile") == 1
        assert "_tile" not in calls and "_tile_coords" not in calls and "range" in calls


def test_l2_section_sizes():
    """Sections hold whole GQA groups whose K/V fit the budget (50 MiB unless the settings
    say otherwise), at least one group, at most every pair."""
    assert pg.GluonSettings().l2_section_bytes == pg.L2_SECTION_BYTES == 50 * 2 ** 20
    # 4k keys, D128, bf16: 2 MiB of K/V a KV head -> 25 KV heads -> 25 groups of 4
    assert pg.l2_section(10 ** 4, 4, 4096, 128, 2) == 25 * 4
    assert pg.l2_section(10 ** 4, 4, 4096, 128, 2, budget=4 * 2 ** 20) == 2 * 4
    assert pg.l2_section(32, 4, 4096, 128, 2) == 32  # all pairs fit
    assert pg.l2_section(64, 8, 10 ** 7, 128, 2) == 8  # one group even past L2
    assert pg.l2_section(64, 8, 4096, 128, 2, budget=1) == 8


def test_persistent_launcher_grid_and_arguments(monkeypatch):
    """persistent=True launches min(tiles, SMs) CTAs (the interpreter target has 4) with
    n_bh = B * Hq and l2_section's section; the default launch passes None for both
    (recorded on CPU tensors with the kernel replaced; nothing runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    q, k, v = _qkv(2, 300, 300, 8, 2, 128, torch.bfloat16)
    s = pg.settings_for(128, True, persistent=True)
    pg.prefill(q, k, v, True, 0.125, settings=s)
    pg.prefill(q, k, v, True, 0.125, settings=pg.settings_for(128, True))
    pg.prefill(q, k, v, True, 0.125, settings=replace(s, l2_section_bytes=1))
    (grid, args, kw), (grid0, args0, kw0), (_, args1, _) = rec.launches
    assert grid == (4, ) and grid0 == (3 * 2 * 8, )
    # (..., n_bh, section, tiles, v_rows, block_table, bt_stride, bt_width, page_stride): fixed
    # length has no tile table, no bounded V, no pages
    assert args[14:] == (16, pg.l2_section(16, 4, 300, 128, 2)) + (None,) * 6
    assert args[14:16] == (16, 16)
    assert args0[14:] == (None,) * 8
    assert args1[14:16] == (16, 4)  # one GQA group a section
    assert kw["PERSISTENT"] is True and kw0["PERSISTENT"] is False and kw["UNROLL"] is False
    one = _qkv(1, 5, 5, 2, 1, 64, torch.bfloat16)  # fewer tiles than SMs: one CTA a tile
    pg.prefill(*one, False, 0.125, settings=pg.settings_for(64, False, persistent=True))
    assert rec.launches[-1][0] == (2, )


@pytest.mark.parametrize("head_dim, causal, sq, persistent", [
    (64, False, 1024, True), (64, False, 1025, False), (64, False, 513, True),
    (64, False, 512, False), (64, True, 1024, False), (128, False, 1024, False),
    (128, True, 300, False)])
def test_default_takes_the_persistent_schedule_where_it_measured_faster(
        monkeypatch, head_dim, causal, sq, persistent):
    """Without settings, a fixed-length call takes the persistent schedule only where
    PERSISTENT_UP_TO says (D64 non-causal, Sq <= 1024) and ONE_CONSUMER_UP_TO does not
    (Sq <= 512 takes the one-consumer build), with PER_PERSISTENT's UNROLL; the varlen
    launcher never does (recorded; nothing runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    pg.prefill(*_qkv(1, sq, sq, 2, 1, head_dim, torch.bfloat16), causal, 0.125)
    kw = rec.launches[-1][2]
    assert kw["PERSISTENT"] is persistent
    if persistent:
        assert kw["UNROLL"] is False and rec.launches[-1][0][0] <= 4  # min(tiles, SMs)
    assert pg.PERSISTENT_UP_TO == {(64, False): 1024}


@pytest.mark.parametrize("head_dim, causal, sq, consumers", [
    (128, True, 1024, 1), (128, True, 1025, 2), (128, True, 1, 1), (128, False, 1024, 2),
    (128, False, 256, 1), (128, False, 257, 2), (128, False, 17, 1), (64, True, 2048, 1),
    (64, True, 2049, 3), (64, False, 512, 1), (64, False, 1, 1), (64, False, 1025, 3)])
def test_default_takes_the_one_consumer_build_where_it_measured_faster(
        monkeypatch, head_dim, causal, sq, consumers):
    """Without settings, a fixed-length call of at most ONE_CONSUMER_UP_TO query rows
    (causal D128 1024, D64 2048; non-causal D128 256, D64 512) launches the one-consumer
    build: 64-row tiles (one CTA a 64-row block), the register
    cap of its CTAs an SM (maxnreg), ONE_CONSUMER's ring; others the default build without
    a cap (recorded on CPU tensors with the kernel replaced; nothing runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    pg.prefill(*_qkv(1, sq, sq, 2, 1, head_dim, torch.bfloat16), causal, 0.125)
    grid, _, kw = rec.launches[-1]
    assert kw["CONSUMERS"] == consumers and kw["BLOCK_M"] == 64 * consumers
    assert grid == (-(-sq // (64 * consumers)) * 2, )
    if consumers == 1:
        want = pg.ONE_CONSUMER[head_dim]
        assert (kw["BLOCK_N"], kw["STAGES"], kw["PINGPONG"]) == (want["BLOCK_N"],
                                                               want["STAGES"], False)
        assert kw["maxnreg"] == {128: 128, 64: 80}[head_dim]
    else:
        assert "maxnreg" not in kw
    assert pg.ONE_CONSUMER_UP_TO == {(128, True): 1024, (128, False): 256, (64, True): 2048,
                                     (64, False): 512}


def test_one_consumer_settings_are_checked():
    """CONSUMERS=1 derives BLOCK_M 64, two CTAs an SM and 232 registers (maxnreg 128 less
    the producer's warpgroup at 24); three CTAs cap at 80 and give the consumer 136; the
    checks refuse ping-pong, registers that are not the cap's, several CTAs with more
    consumers and a ring over the CTA's share of shared memory, naming the setting."""
    s = pg.settings_for(128, True, CONSUMERS=1, BLOCK_N=64, STAGES=3)
    assert (s.BLOCK_M, s.ctas_per_sm, s.CONSUMER_REGS, s.maxnreg()) == (64, 2, 232, 128)
    assert s.launch_options() == {"num_warps": 4, "maxnreg": 128}
    assert pg.settings_for(128, True).launch_options() == {"num_warps": 4}
    three = pg.settings_for(64, True, **pg.ONE_CONSUMER[64])
    assert (three.ctas_per_sm, three.CONSUMER_REGS, three.maxnreg()) == (3, 136, 80)
    assert 3 * (three.smem_bytes(64) + 1024) <= pg.SM_SMEM
    with pytest.raises(ValueError, match=r"PINGPONG=True needs CONSUMERS >= 2"):
        pg.settings_for(128, False, CONSUMERS=1, BLOCK_N=64, STAGES=3, PINGPONG=True)
    with pytest.raises(ValueError, match=r"CONSUMER_REGS=232: with ctas_per_sm=3"):
        pg.settings_for(64, True, CONSUMERS=1, ctas_per_sm=3, BLOCK_N=64, STAGES=3)
    with pytest.raises(ValueError, match=r"ctas_per_sm=2: 1, or 2-3 with CONSUMERS=1"):
        pg.settings_for(128, True, ctas_per_sm=2)
    with pytest.raises(ValueError, match=r"2 CTA\(s\) an SM of sm_90 have 115712 each"):
        pg.settings_for(128, True, CONSUMERS=1)  # 2 x 128 keys x 2 stages: 147 KB
    with pytest.raises(ValueError, match=r"CONSUMERS=4: the Gluon kernel has 1, 2 or 3"):
        pg.settings_for(128, True, CONSUMERS=4)


@pytest.mark.parametrize("build", ["fixed", "varlen", "paged"])
@pytest.mark.parametrize("head_dim, causal", COMPILE_CASES)
def test_sm90_one_consumer_structure(head_dim, causal, build):
    """The one-consumer build (ONE_CONSUMER, causal and not, fixed-length, packed and over
    pages of 16): the default partition is the consumer, the 1-warp producer the only
    worker (at 24 registers), 256 threads under the cap that fits ctas_per_sm CTAs
    (.maxnreg), the consumer raised to the rest, wgmma and TMA as in the other builds, no
    spills, and shared memory within the CTA's share."""
    s = pg.settings_for(head_dim, causal, **pg.ONE_CONSUMER[head_dim])
    varlen, paged = build != "fixed", build == "paged"
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, settings=s, varlen=varlen,
                           page=16 if paged else 0)
    _assert_one_consumer_structure(_compile_spec(spec), s, varlen)


# The one-consumer build's key tiles are BLOCK_N = 64 rows (ONE_CONSUMER), so its box
# shapes fall at other pages than the default build's: 8, 16 and 32 are boxes smaller
# than the tile (eight, four, two a tile), 64 one box a tile, 128 and up a page of several
# tiles. Pages 16 are in test_sm90_one_consumer_structure; each other page here once,
# the one box a tile at both head dims.
ONE_CONSUMER_PAGED_CASES = [
    pytest.param(d, c, page, id=f"D{d}-{'causal' if c else 'full'}-{page}")
    for d, c, page in ((128, False, 8), (64, True, 8), (64, False, 32), (128, True, 64),
                       (64, False, 64), (128, False, 128), (64, True, 256), (128, True, 512))]


@pytest.mark.parametrize("head_dim, causal, page", ONE_CONSUMER_PAGED_CASES)
def test_sm90_one_consumer_paged_pages(head_dim, causal, page):
    """The one-consumer paged build at the pages other than 16, as the launcher picks it
    for a chunk of at most ONE_CONSUMER_CHUNK_UP_TO queries against any prefix: the
    structure of test_sm90_one_consumer_structure, no spills, min(page, BLOCK_N)-row
    boxes."""
    s = pg.varlen_call_settings(head_dim, causal, pg.ONE_CONSUMER_CHUNK_UP_TO, 32768)
    assert s == pg.one_consumer_settings(head_dim, causal) and s.BLOCK_N == 64
    spec = pg.compile_spec(head_dim=head_dim, causal=causal, settings=s, varlen=True,
                           page=page)
    assert f"[1,{min(page, s.BLOCK_N)},{head_dim}]" in spec["signature"]["k_desc"]
    assert spec["constexprs"]["PAGE"] == page
    _assert_one_consumer_structure(_compile_spec(spec), s, True)


def _assert_one_consumer_structure(k, s, varlen):
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    ws = re.findall(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: ([0-9, ]+)>", ttgir)
    assert ws == [str(s.PRODUCER_REGS)]
    parts = re.findall(r"^\s*partition(\d+)\(.*num_warps\((\d+)\)", ttgir, re.M)
    assert [(int(i), int(w)) for i, w in parts] == [(0, 1)]
    assert k.metadata.num_warps == 8 and ".reqntid 256" in ptx
    assert re.search(r"\.maxnreg (\d+)", ptx).group(1) == str(s.maxnreg())
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert ("inc", str(s.CONSUMER_REGS)) in regs and (
        ("dec", "24") in regs or ("inc", "24") in regs), regs
    assert ttgir.count("ttng.warp_group_dot") >= 2
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx)
    assert "cp.async.bulk.tensor" in ptx
    assert _ptxas_spill_bytes(ptx) == [0, 0]
    assert s.ctas_per_sm * (k.metadata.shared + 1024) <= pg.SM_SMEM
    # packs and pages: V's rows past a sequence's keys are zeroed in shared memory by the
    # consumer (a load and a store of the tile) and fenced for the wgmma, no V descriptor
    # made on the device (notes/prefill_gluon.md, "Packs on the one-consumer build");
    # O's store through the Q buffer is the other store and fence
    assert ttgir.count("ttg.local_load") == int(varlen)
    assert ttgir.count("ttg.local_store") == ptx.count("fence.proxy.async") == 1 + varlen
    assert "tensormap.replace" not in ptx


def test_persistent_varlen_is_refused_by_name(monkeypatch):
    """Varlen and the paged build have no persistent schedule: the launchers and
    compile_spec say so. Both take the one-consumer build."""
    rec = _Recorder()
    monkeypatch.setattr(pg, "attn_fwd_kernel", rec)
    q, k, v, cu_q, cu_k = _pack([5, 7], [5, 7], 4, 2, 64, torch.float16)
    s = pg.settings_for(64, False, persistent=True)
    with pytest.raises(ValueError, match=r"persistent=True.*fixed-length prefill only"):
        pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, False, 0.125, settings=s)
    with pytest.raises(ValueError, match=r"persistent=True.*fixed-length prefill only"):
        pg.compile_spec(head_dim=64, settings=s, varlen=True)
    kc, vc, table, lens = _paged(k, v, [5, 7], 64, seed=0)
    with pytest.raises(ValueError, match=r"persistent=True.*fixed-length prefill only"):
        pg.prefill_paged(q, kc, vc, cu_q, lens, table, None, True, 0.125, settings=s)
    with pytest.raises(ValueError, match=r"persistent=True.*fixed-length prefill only"):
        pg.compile_spec(head_dim=64, settings=s, varlen=True, page=64)
    assert rec.launches == []
    one = pg.settings_for(64, True, **pg.ONE_CONSUMER[64])
    pg.compile_spec(head_dim=64, causal=True, settings=one, varlen=True)
    pg.compile_spec(head_dim=64, causal=True, settings=one, varlen=True, page=64)


# --------------------------------------------------------------------------- sm_90 GPU

GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, causal
    (1, 1, 1, 2, 1, 64, False),
    (2, 17, 17, 4, 2, 64, True),
    (2, 127, 127, 8, 2, 128, False),
    (2, 127, 127, 8, 8, 128, True),
    (1, 300, 300, 8, 1, 128, True),   # GQA 8:1
    (2, 17, 300, 4, 4, 128, True),    # q_len < kv_len, bottom-right causal
    (1, 1, 257, 8, 1, 64, True),
    (1, 384, 1000, 8, 2, 64, True),
    (2, 1000, 1000, 4, 4, 128, False),
    # the issue's odd lengths on the builds the launcher picks for them (the one-consumer
    # build up to its limits, the multi-consumer default past them), GQA 7:1 among them
    (1, 63, 63, 7, 1, 64, True),
    (2, 64, 64, 8, 2, 128, False),
    (1, 65, 65, 14, 2, 128, True),
    (1, 8191, 8191, 4, 1, 128, False),
    (1, 8191, 8191, 7, 1, 64, True),
]


def _gpu_id(c):
    B, Sq, Sk, Hq, Hkv, D, causal = c
    return f"B{B}-Sq{Sq}-Sk{Sk}-H{Hq}-HKV{Hkv}-D{D}-{'causal' if causal else 'full'}"


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[_gpu_id(c) for c in GPU_CASES])
def test_sm90_numerics(case, dtype):
    import wsattn
    from wsattn import reference
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = _qkv(B, Sq, Sk, Hq, Hkv, D, dtype, "cuda")
    out, lse = wsattn.attention(q, k, v, causal=causal, return_lse=True, impl="gluon")
    ref, ref_lse = reference.attention(q, k, v, causal)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    again = wsattn.attention(q, k, v, causal=causal, return_lse=True, impl="gluon")
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@pytest.mark.sm90
@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False), (128, True)],
                         ids=["D64-full", "D64-causal", "D128-full", "D128-causal"])
def test_sm90_one_loop_same_bits(head_dim, causal):
    """The masked tiles in the unmasked loop's body (ONE_LOOP) compute what the masked loop
    of its own does, in the same order: output and LSE bit-identical between the two builds
    (777 rows: a partial last key tile without a mask, the diagonal with one)."""
    q, k, v = _qkv(2, 777, 777, 8, 2, head_dim, torch.bfloat16, "cuda")
    scale = 1 / math.sqrt(head_dim)
    one = pg.prefill(q, k, v, causal, scale,
                     settings=pg.settings_for(head_dim, causal, ONE_LOOP=True))
    two = pg.prefill(q, k, v, causal, scale,
                     settings=pg.settings_for(head_dim, causal, ONE_LOOP=False))
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False), (128, True)],
                         ids=["D64-full", "D64-causal", "D128-full", "D128-causal"])
def test_sm90_packed_p_same_bits(head_dim, causal, dtype):
    """P packed by one cvt.rn a register pair (the default) rounds as p.to(dtype) does:
    output and LSE bit-identical to the PACK_P=False build."""
    from wsattn.kernels import prefill_gluon as pg
    q, k, v = _qkv(2, 777, 777, 8, 2, head_dim, dtype, "cuda")
    scale = 1 / math.sqrt(head_dim)
    packed = pg.prefill(q, k, v, causal, scale, settings=pg.settings_for(head_dim, causal))
    plain = pg.prefill(q, k, v, causal, scale,
                       settings=pg.settings_for(head_dim, causal, PACK_P=False))
    assert torch.equal(packed[0], plain[0]) and torch.equal(packed[1], plain[1])


@pytest.mark.sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_strided_inputs(causal):
    """BHSD tensors seen as BSHD (last dim contiguous only) go through a copy, same answer."""
    import wsattn
    from wsattn import reference
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, h, 130, 64, dtype=torch.bfloat16, device="cuda", generator=g)
               .transpose(1, 2) for h in (8, 2, 2))  # [B, S, H, D] views of [B, H, S, D]
    out = wsattn.attention(q, k, v, causal=causal, impl="gluon")
    ref, _ = reference.attention(q, k, v, causal)
    assert_close(out, ref, torch.bfloat16)


C3_GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, causal: odd lengths around the 192-row tile
    (1, 1, 1, 2, 1, False),
    (2, 193, 193, 4, 2, True),
    (1, 300, 300, 8, 1, False),   # GQA 8:1
    (2, 17, 300, 4, 4, True),     # q_len < kv_len, bottom-right causal
    (1, 384, 1000, 8, 2, True),
    (2, 1000, 1000, 4, 4, False),
]


@pytest.mark.sm90
@pytest.mark.parametrize("variant", [{}, {"PINGPONG": True}], ids=["c3", "c3-pingpong"])
@pytest.mark.parametrize("case", C3_GPU_CASES,
                         ids=[_gpu_id((*c[:5], 64, c[5])) for c in C3_GPU_CASES])
def test_sm90_three_consumers_numerics(case, variant):
    """CONSUMERS=3 (192-row tiles, D=64) against the float64 reference, LSE too."""
    from wsattn import reference
    B, Sq, Sk, Hq, Hkv, causal = case
    q, k, v = _qkv(B, Sq, Sk, Hq, Hkv, 64, torch.bfloat16, "cuda")
    s = pg.settings_for(64, causal, CONSUMERS=3, **variant)
    out, lse = pg.prefill(q, k, v, causal, 64 ** -0.5, settings=s)
    ref, ref_lse = reference.attention(q, k, v, causal)
    assert_close(out, ref, torch.bfloat16)
    assert_lse_close(lse, ref_lse, torch.bfloat16)


SCHEDULE_VARIANTS = {"all-tiles": {"WG_TILES": False},
                     # with WG_TILES a warpgroup that skips tiles still passes its turns
                     "pingpong": {"PINGPONG": True},
                     "pingpong-all-tiles": {"PINGPONG": True, "WG_TILES": False},
                     "two-consumers": {"CONSUMERS": 2}}
SCHEDULE_GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, causal: more tiles than SMs in the last two
    (1, 1, 1, 2, 1, 64, False),
    (2, 17, 300, 4, 4, 128, True),
    (1, 300, 300, 8, 1, 128, True),
    (2, 193, 450, 4, 2, 64, True),    # a warpgroup with 1 row, two with none (192-row tiles)
    (1, 130, 130, 4, 4, 64, False),   # the same without a mask
    (4, 1000, 1000, 32, 8, 128, False),
    (3, 777, 777, 32, 4, 64, True),
]


def _settings_numerics(q, k, v, causal, s, reruns):
    """pg.prefill with settings s against the float64 reference (out and LSE, in q's dtype's
    tolerance), then `reruns` more launches bit-identical to the first; (out, lse)."""
    from wsattn import reference
    D = q.shape[-1]
    out, lse = pg.prefill(q, k, v, causal, D ** -0.5, settings=s)
    ref, ref_lse = reference.attention(q, k, v, causal)
    assert_close(out, ref, q.dtype)
    assert_lse_close(lse, ref_lse, q.dtype)
    for _ in range(reruns):
        again, again_lse = pg.prefill(q, k, v, causal, D ** -0.5, settings=s)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)
    return out, lse


@pytest.mark.sm90
@pytest.mark.parametrize("variant", list(SCHEDULE_VARIANTS))
@pytest.mark.parametrize("case", SCHEDULE_GPU_CASES, ids=[_gpu_id(c) for c in SCHEDULE_GPU_CASES])
def test_sm90_schedule_variants_numerics(case, variant):
    """The tile and turn switches against the float64 reference, and bit-identical on a
    rerun."""
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = _qkv(B, Sq, Sk, Hq, Hkv, D, torch.float16, "cuda")
    _settings_numerics(q, k, v, causal, pg.settings_for(D, causal, **SCHEDULE_VARIANTS[variant]),
                       reruns=20)


def test_auto_prefers_triton_only_where_it_measured_faster():
    """Varlen calls of causal query chunks under 256 (and D=64 non-causal ones up to 1024)
    against longer keys go to Triton under impl="auto" on sm_90; packs whose queries and
    keys are all short, and the rest, every fixed-length call included, to Gluon (the
    policy lives in wsattn.dispatch, the one place impl="auto" is resolved)."""
    from wsattn.dispatch import Call, ranking
    dev = torch.device("cuda", 0)

    def first(S, D, causal):
        return ranking(Call("prefill", dev, torch.bfloat16, D, causal, S, S))[0]

    # fixed length: the Gluon kernel everywhere (short causal calls on its one-consumer
    # build, prefill_gluon.ONE_CONSUMER_UP_TO)
    assert first(1024, 128, True) == "gluon" and first(1025, 128, True) == "gluon"
    assert first(1024, 128, False) == "gluon"
    assert first(1024, 64, False) == "gluon" and first(4096, 64, False) == "gluon"
    assert first(1024, 64, True) == "gluon" and first(17, 64, True) == "gluon"
    assert first(4096, 64, True) == "gluon"
    # varlen: packs whose longest query and key sequences (max_seqlen_q / _k, else the
    # packed totals) fit VARLEN_ONE_CONSUMER_UP_TO go to Gluon's one-consumer build; the
    # length table then ranks by the longest query sequence
    def first_varlen(Sq, D, causal, Sk=None):
        return ranking(Call("prefill_varlen", dev, torch.bfloat16, D, causal, Sq,
                            Sq if Sk is None else Sk))[0]

    assert first_varlen(3851, 128, True) == "gluon" and first_varlen(3851, 64, False) == "gluon"
    for D, causal in ((128, True), (128, False), (64, True), (64, False)):
        limit = pg.VARLEN_ONE_CONSUMER_UP_TO[(D, causal)]
        assert first_varlen(limit, D, causal) == "gluon"
        assert pg.varlen_one_consumer(D, causal, limit, limit)
        assert not pg.varlen_one_consumer(D, causal, limit, limit + 1)
        assert not pg.varlen_one_consumer(D, causal, limit + 1, limit)
    # causal chunks against longer keys: Gluon at every length; up to
    # ONE_CONSUMER_CHUNK_UP_TO queries, with a mask or without, its one-consumer build;
    # longer ones without a mask the table
    from wsattn import dispatch
    assert dispatch.VARLEN_TRITON_FASTER_UP_TO == {(64, False): 1024}
    for D in (64, 128):
        for chunk in (1, 64, 65, 255, 256, 1024):
            assert first_varlen(chunk, D, True, 33000) == "gluon"
            assert pg.varlen_one_consumer(D, True, chunk, 33000) == (chunk <= 64)
        assert pg.varlen_one_consumer(D, False, 64, 33000)
        assert not pg.varlen_one_consumer(D, False, 65, 33000)
    assert first_varlen(1024, 128, False, 4096) == "gluon"
    assert first_varlen(900, 64, False, 2000) == "triton"
    assert first_varlen(65, 64, False, 2000) == "triton"
    assert first_varlen(64, 64, False, 2000) == "gluon"  # the short-chunk rule
    assert ranking(Call("prefill_varlen", dev, torch.bfloat16, 128, True, 3851, 3851)) == \
        ("gluon", "triton")


@pytest.mark.sm90
def test_sm90_auto_picks_gluon_and_reruns_bit_identical():
    import wsattn
    q, k, v = _qkv(2, 1100, 1100, 8, 2, 128, torch.bfloat16, "cuda")
    first = wsattn.attention(q, k, v, causal=True, impl="auto")
    gl_out = wsattn.attention(q, k, v, causal=True, impl="gluon")
    assert torch.equal(first, gl_out)
    for _ in range(200):
        assert torch.equal(wsattn.attention(q, k, v, causal=True, impl="gluon"), first)


# --------------------------------------------------------------------------- varlen, sm_90 GPU

VARLEN_PACKS = {  # name: (q lens, kv lens), kv >= q everywhere but "no-keys"
    "1": ([1], [1]),
    "63-64-65": ([63, 64, 65], [63, 100, 65]),
    "1000": ([1000], [1000]),
    "8191": ([8191], [8191]),
    # empty sequences (no queries; no queries and no keys) among odd lengths, every
    # boundary inside a 64-row box and a BLOCK_N-key tile
    "mix": ([0, 65, 0, 1, 1000, 63, 0, 64, 129, 193, 17],
            [0, 65, 17, 1, 1100, 63, 0, 64, 300, 193, 2000]),
    # non-causal only: queries that see no key (kv_len 0) get out 0 and lse -inf
    "no-keys": ([65, 30, 64, 1], [65, 0, 100, 0]),
}
VARLEN_GPU_CASES = [pytest.param(p, d, c, id=f"{p}-D{d}-{'causal' if c else 'full'}")
                    for p in VARLEN_PACKS for d in (64, 128) for c in (False, True)
                    if not (c and p == "no-keys")]
VARLEN_HQ, VARLEN_HKV = 14, 2  # GQA 7:1, two KV heads so KV head offsets are exercised


def _assert_varlen_close(out, lse, ref, ref_lse, cu_q, dtype):
    """Whole pack, then each sequence on its own and its first and last 64 rows (where a
    box straddles a boundary): one wrong row in a long pack would hide in the norm."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten rows"
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    bounds = cu_q.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for lo, hi in {(a, b), (a, min(b, a + 64)), (max(a, b - 64), b)}:
            if lo == hi:
                continue
            assert_close(out[lo:hi], ref[lo:hi], dtype, f"out rows {lo}:{hi} (sequence {i})")
            assert_lse_close(lse[:, lo:hi], ref_lse[:, lo:hi], dtype,
                             f"lse rows {lo}:{hi} (sequence {i})")


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pack, head_dim, causal", VARLEN_GPU_CASES)
def test_sm90_varlen_numerics(pack, head_dim, causal, dtype):
    """Packed sequences through the public API (impl="gluon") against the float64 reference,
    per sequence and at every boundary; max_seqlen omitted gives the bits of the call given
    the token totals; bit-identical reruns."""
    import wsattn
    from wsattn import reference
    q_lens, kv_lens = VARLEN_PACKS[pack]
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, dtype, "cuda",
                                seed=len(q_lens) + head_dim)
    scale = 1.0 / math.sqrt(head_dim)  # the API's default, bit for bit (128 ** -0.5 is not)
    out, lse = wsattn.attention_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens),
                                       causal=causal, sm_scale=scale, return_lse=True,
                                       impl="gluon")
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale)
    assert out.shape == q.shape and lse.shape == (VARLEN_HQ, q.shape[0])
    _assert_varlen_close(out, lse, ref, ref_lse, cu_q, dtype)
    # default sm_scale and max_seqlen: the bounds fall back to the token totals (no host
    # sync), which can pick the other build (mix at D64 causal: longest keys 2000, total
    # 3803 against VARLEN_ONE_CONSUMER_UP_TO's 2048), so the omitted call has the bits of
    # the call given the totals, and is checked against the reference on its own
    omitted = wsattn.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                      impl="gluon")
    totals = wsattn.attention_varlen(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0],
                                     causal=causal, sm_scale=scale, return_lse=True,
                                     impl="gluon")
    assert torch.equal(omitted[0], totals[0]) and torch.equal(omitted[1], totals[1])
    _assert_varlen_close(*omitted, ref, ref_lse, cu_q, dtype)
    for _ in range(3):
        again, again_lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(kv_lens),
                                             causal, scale)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.sm90
@pytest.mark.parametrize("build", ["default", "one-consumer"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_sm90_varlen_writes_only_its_rows(head_dim, causal, build):
    """Each sequence of the mixed pack launched alone (cu_seqlens[i:i + 2] over the whole
    pack): every O and LSE row outside it, the rows right after its end included, keeps
    the NaN poison, so no straddling box wrote into the next sequence; its own rows are
    bit-identical to the whole pack's launch. The default build and the one-consumer one
    (64-row boxes)."""
    q_lens, kv_lens = VARLEN_PACKS["mix"]
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, torch.bfloat16,
                                "cuda", seed=3)
    scale = head_dim ** -0.5
    s = pg.settings_for(head_dim, causal, **(pg.ONE_CONSUMER[head_dim]
                                             if build == "one-consumer" else {}))
    full, full_lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, causal, scale,
                                       settings=s)
    bounds = cu_q.tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        out, lse = pg.prefill_varlen(q, k, v, cu_q[i:i + 2], cu_k[i:i + 2], None, None, causal,
                                     scale, settings=s)
        mine = torch.zeros(q.shape[0], dtype=torch.bool, device="cuda")
        mine[a:b] = True
        assert torch.isnan(out[~mine]).all(), f"sequence {i} wrote rows outside {a}:{b}"
        assert torch.isnan(lse[:, ~mine]).all(), f"sequence {i} wrote LSE outside {a}:{b}"
        assert torch.equal(out[a:b], full[a:b]) and torch.equal(lse[:, a:b], full_lse[:, a:b])


@pytest.mark.sm90
@pytest.mark.parametrize("build", ["default", "one-consumer"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_sm90_varlen_a_neighbours_nonfinite_v_stays_out(head_dim, causal, build):
    """The default varlen build (varlen_bounded_v): with NaN and Inf in every row of k and
    v but one sequence's, that sequence's rows equal its own launch's on clean keys (a
    sequence must not see another request's values, whatever they hold); on finite inputs
    it equals the build with the setting off bit for bit. The build with it off (pack-wide
    V descriptor) does not pass the first part: its last key tile adds 0 * v for the next
    sequence's rows (notes/prefill_gluon.md). The default build bounds V by a descriptor
    made on the device, the one-consumer build by zeroing the rows in shared memory."""
    q_lens, kv_lens = VARLEN_PACKS["mix"]
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, torch.bfloat16,
                                "cuda", seed=5)
    scale = head_dim ** -0.5
    over = pg.ONE_CONSUMER[head_dim] if build == "one-consumer" else {}
    bounded = pg.settings_for(head_dim, causal, **over)
    assert bounded.varlen_bounded_v
    base = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, causal, scale,
                             settings=pg.settings_for(head_dim, causal, varlen_bounded_v=False,
                                                      **over))
    mine = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, causal, scale, settings=bounded)
    assert torch.equal(mine[0], base[0]) and torch.equal(mine[1], base[1])
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in (1, 4, 8):  # sequences whose last key tile ends inside the pack
        clean, clean_lse = pg.prefill_varlen(q, k, v, cu_q[i:i + 2], cu_k[i:i + 2], None, None,
                                             causal, scale, settings=bounded)
        dirty_v = torch.full_like(v, float("nan"))
        dirty_v[1::2] = float("inf")
        dirty_v[bk[i]:bk[i + 1]] = v[bk[i]:bk[i + 1]]
        dirty_k = torch.full_like(k, float("nan"))
        dirty_k[bk[i]:bk[i + 1]] = k[bk[i]:bk[i + 1]]
        out, lse = pg.prefill_varlen(q, dirty_k, dirty_v, cu_q, cu_k, None, None, causal, scale,
                                     settings=bounded)
        a, b = bq[i], bq[i + 1]
        assert torch.equal(out[a:b], clean[a:b]), f"sequence {i} saw its neighbours' values"
        assert torch.equal(lse[:, a:b], clean_lse[:, a:b]), f"sequence {i}'s LSE"


@pytest.mark.sm90
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("pack, head_dim, causal", [
    pytest.param(p, d, c, id=f"{p}-D{d}-{'causal' if c else 'full'}")
    for p in ("63-64-65", "mix", "8191") for d in (64, 128) for c in (False, True)
    if p != "8191" or c])
def test_sm90_paged_equals_varlen_on_the_packed_keys(pack, head_dim, causal, page):
    """The paged build over shuffled pages (every row no key owns NaN, table entries past a
    sequence's pages -1), the default and the one-consumer build: out and LSE bit for bit
    prefill_varlen's with the same settings on the same keys packed (the same tiles in the
    same order; V past a sequence's keys is zeros here and the next sequence's rows there,
    both times a probability of 0), over reruns, and within tolerance of float64. Without
    settings the paged launcher takes the build the varlen rule picks for its longest
    chunk and the table's width in keys, so the same bits as that build."""
    from wsattn import reference
    q_lens, kv_lens = VARLEN_PACKS[pack]
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, dtype, "cuda",
                                seed=len(q_lens) + head_dim + page)
    kc, vc, table, lens = _paged(k, v, kv_lens, page, seed=page)
    scale = head_dim ** -0.5
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale)
    want = {}
    for build, over in (("default", {}), ("one-consumer", pg.ONE_CONSUMER[head_dim])):
        s = pg.settings_for(head_dim, causal, **over)
        want[build] = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, causal, scale,
                                        settings=s)
        for max_q in (None, max(q_lens), None):
            got = pg.prefill_paged(q, kc, vc, cu_q, lens, table, max_q, causal, scale,
                                   settings=s)
            assert torch.equal(got[0], want[build][0]), (build, max_q)
            assert torch.equal(got[1], want[build][1]), (build, max_q)
        _assert_varlen_close(got[0], got[1], ref, ref_lse, cu_q, dtype)
    for max_q in (None, max(q_lens)):
        bound = sum(q_lens) if max_q is None else max_q
        picked = pg.varlen_one_consumer(head_dim, causal, bound, table.shape[1] * page)
        got = pg.prefill_paged(q, kc, vc, cu_q, lens, table, max_q, causal, scale)
        w = want["one-consumer" if picked else "default"]
        assert torch.equal(got[0], w[0]) and torch.equal(got[1], w[1]), max_q


@pytest.mark.sm90
@pytest.mark.parametrize("pack, head_dim, causal", VARLEN_GPU_CASES)
def test_sm90_compact_varlen_equals_the_plain_grid(pack, head_dim, causal):
    """compact_varlen=True (the default: the tile-table grid) computes each tile with the
    same code as the plain grid (compact_varlen=False): out and LSE bit-identical to it (so within tolerance of float64 as
    test_sm90_varlen_numerics checks), over reruns, with max_seqlen given and omitted, and
    every row outside the sequences' (the NaN poison of empty ones) untouched alike; so
    does the table with its sequences in pack order (varlen_longest_first=False; the
    default lists them longest first)."""
    from wsattn import reference
    q_lens, kv_lens = VARLEN_PACKS[pack]
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, dtype, "cuda",
                                seed=len(q_lens) + head_dim + 1)
    scale = head_dim ** -0.5
    plain = pg.prefill_varlen(q, k, v, cu_q, cu_k, max(q_lens), None, causal, scale,
                              settings=pg.settings_for(head_dim, causal, compact_varlen=False))
    s = pg.settings_for(head_dim, causal)
    for max_q in (max(q_lens), None, max(q_lens), None):
        out, lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, scale, settings=s)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), max_q
    # the table's sequences in pack order: the same tiles, started in another order
    packorder = pg.settings_for(head_dim, causal, varlen_longest_first=False)
    for max_q in (max(q_lens), None):
        got = pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, scale,
                                settings=packorder)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), max_q
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale)
    _assert_varlen_close(out, lse, ref, ref_lse, cu_q, dtype)


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pack, head_dim, causal", VARLEN_GPU_CASES)
def test_sm90_varlen_one_consumer_numerics(pack, head_dim, causal, dtype):
    """The one-consumer build on packs (ONE_CONSUMER: 64-row tiles, two or three CTAs an
    SM, V's rows past a sequence's keys zeroed by the consumer): against the float64 reference per sequence and at every boundary, the tile
    table's launch bit for bit the plain grid's, max_seqlen given or omitted, over reruns."""
    from wsattn import reference
    q_lens, kv_lens = VARLEN_PACKS[pack]
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, dtype, "cuda",
                                seed=len(q_lens) + head_dim + 2)
    scale = head_dim ** -0.5
    s = pg.settings_for(head_dim, causal, **pg.ONE_CONSUMER[head_dim])
    plain = pg.prefill_varlen(q, k, v, cu_q, cu_k, max(q_lens), None, causal, scale,
                              settings=replace(s, compact_varlen=False))
    for max_q in (max(q_lens), None, max(q_lens)):
        out, lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, max_q, None, causal, scale, settings=s)
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1]), max_q
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal, scale)
    _assert_varlen_close(out, lse, ref, ref_lse, cu_q, dtype)


VARLEN_SCHEDULE_CASES = [  # variant, head dim, causal: the switches off their defaults
    # (ping-pong is the default at D64 non-causal, so test_sm90_varlen_numerics covers it)
    ("all-tiles", 64, True), ("all-tiles", 128, False), ("two-consumers", 64, True)]


@pytest.mark.sm90
@pytest.mark.parametrize("variant, head_dim, causal", VARLEN_SCHEDULE_CASES,
                         ids=[f"{v}-D{d}-{'causal' if c else 'full'}"
                              for v, d, c in VARLEN_SCHEDULE_CASES])
def test_sm90_varlen_schedule_variants(variant, head_dim, causal):
    """The tile and turn switches with varlen: producer and consumers agree on every tile
    count (a warpgroup past its sequence's end, sequences with no work), same numerics."""
    from wsattn import reference
    q_lens, kv_lens = VARLEN_PACKS["mix"]
    q, k, v, cu_q, cu_k = _pack(q_lens, kv_lens, VARLEN_HQ, VARLEN_HKV, head_dim, torch.float16,
                                "cuda", seed=5)
    s = pg.settings_for(head_dim, causal, **SCHEDULE_VARIANTS[variant])
    out, lse = pg.prefill_varlen(q, k, v, cu_q, cu_k, None, None, causal, head_dim ** -0.5,
                                 settings=s)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal)
    _assert_varlen_close(out, lse, ref, ref_lse, cu_q, torch.float16)


# --------------------------------------------------------------------------- persistent, sm_90 GPU

PERSISTENT_GPU_CASES = [  # B, S (= Sq = Sk unless a pair), Hq, Hkv, D, causal
    (1, 1, 2, 1, 64, False),
    (2, 63, 4, 2, 128, True),
    (3, 64, 8, 2, 64, True),
    (2, 65, 4, 4, 128, False),
    (2, (17, 300), 4, 4, 128, True),  # q_len < kv_len, bottom-right causal
    (2, 1000, 8, 1, 64, True),        # GQA 8:1
    (4, 1000, 32, 8, 128, True),      # 1024 tiles: ~8 a CTA, every phase carried across
    (1, 8191, 4, 1, 128, True),
    (1, 8191, 4, 2, 64, False),
]


def _persistent_id(c):
    B, S, Hq, Hkv, D, causal = c
    Sq, Sk = S if isinstance(S, tuple) else (S, S)
    return _gpu_id((B, Sq, Sk, Hq, Hkv, D, causal))


@pytest.mark.sm90
@pytest.mark.parametrize("case", PERSISTENT_GPU_CASES,
                         ids=[_persistent_id(c) for c in PERSISTENT_GPU_CASES])
def test_sm90_persistent_numerics(case):
    """persistent=True against the float64 reference (out and LSE), bit-identical to itself
    over reruns, and equal to the one-tile-per-CTA kernel within tolerance."""
    B, S, Hq, Hkv, D, causal = case
    Sq, Sk = S if isinstance(S, tuple) else (S, S)
    q, k, v = _qkv(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, "cuda")
    out, lse = _settings_numerics(q, k, v, causal, pg.settings_for(D, causal, persistent=True),
                                  reruns=5)
    one, one_lse = pg.prefill(q, k, v, causal, D ** -0.5)
    assert_close(out.double(), one.double(), torch.bfloat16, "persistent vs one tile a CTA")
    assert_close(lse.double(), one_lse.double(), torch.bfloat16, "lse, persistent vs one tile")


ONE_CONSUMER_GPU_CASES = [  # B, Sq, Sk, Hq, Hkv, D, causal: odd lengths, GQA 7:1, Sq < Sk
    (1, 1, 1, 2, 1, 64, True),
    (2, 63, 63, 7, 1, 128, True),
    (3, 64, 64, 8, 2, 64, True),
    (2, 65, 65, 4, 4, 128, False),
    (2, 17, 300, 4, 4, 128, True),
    (2, 1000, 1000, 14, 2, 64, True),
    (4, 1024, 1024, 32, 8, 128, True),   # 2,048 CTAs, two an SM
    (4, 2048, 2048, 16, 4, 64, True),    # 2,048 CTAs, three an SM
    (1, 8191, 8191, 4, 1, 128, True),
    (1, 8191, 8191, 4, 2, 64, False),
    (3, 256, 256, 8, 2, 128, False),     # the non-causal limits: what auto launches there
    (2, 512, 512, 14, 2, 64, False),
    (2, 1, 129, 4, 1, 64, False),
]


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ONE_CONSUMER_GPU_CASES,
                         ids=[_gpu_id(c) for c in ONE_CONSUMER_GPU_CASES])
def test_sm90_one_consumer_numerics(case, dtype):
    """The one-consumer build (ONE_CONSUMER: two CTAs an SM at D128, three at D64) against
    the float64 reference (out and LSE), bit-identical over reruns, and what a call
    without settings launches where ONE_CONSUMER_UP_TO covers it (bit for bit)."""
    B, Sq, Sk, Hq, Hkv, D, causal = case
    q, k, v = _qkv(B, Sq, Sk, Hq, Hkv, D, dtype, "cuda")
    out, lse = _settings_numerics(q, k, v, causal, pg.settings_for(D, causal,
                                                                  **pg.ONE_CONSUMER[D]),
                                  reruns=5)
    if Sq <= pg.ONE_CONSUMER_UP_TO.get((D, causal), 0):
        auto, auto_lse = pg.prefill(q, k, v, causal, D ** -0.5)
        assert torch.equal(auto, out) and torch.equal(auto_lse, lse)


@pytest.mark.sm90
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
def test_sm90_one_consumer_fits_its_ctas_an_sm(head_dim):
    """What the one-consumer build was made for, from the driver's occupancy calculator
    (cuOccupancyMaxActiveBlocksPerMultiprocessor at the build's threads and dynamic shared
    memory): ONE_CONSUMER's ctas_per_sm CTAs on an SM (3 at D64, 2 at D128), where the
    default causal build of that head dim takes one."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()

    def ctas(k):
        k._init_handles()  # loads the module; sets its dynamic shared-memory limit
        n = ctypes.c_int(-1)
        rc = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), ctypes.c_void_p(k.function), ctypes.c_int(32 * k.metadata.num_warps),
            ctypes.c_size_t(k.metadata.shared))
        assert rc == 0, f"cuOccupancyMaxActiveBlocksPerMultiprocessor: CUresult {rc}"
        return n.value

    want = pg.settings_for(head_dim, True, **pg.ONE_CONSUMER[head_dim]).ctas_per_sm
    assert ctas(_compile(head_dim, True, **pg.ONE_CONSUMER[head_dim])) == want == \
        {64: 3, 128: 2}[head_dim]
    assert ctas(_compile(head_dim, True)) == 1


PERSISTENT_VARIANT_CASES = [  # head dim, causal, variant: the tile and turn switches
    (64, True, "default"), (64, True, "pingpong"), (64, True, "all-tiles"),
    (64, True, "two-consumers"), (128, False, "default"), (128, False, "pingpong"),
    (128, True, "pingpong-all-tiles")]
PERSISTENT_VARIANTS = {"default": {}, **SCHEDULE_VARIANTS}


@pytest.mark.sm90
@pytest.mark.parametrize("head_dim, causal, variant", PERSISTENT_VARIANT_CASES,
                         ids=[f"D{d}-{'causal' if c else 'full'}-{v}"
                              for d, c, v in PERSISTENT_VARIANT_CASES])
def test_sm90_persistent_small_sections(head_dim, causal, variant):
    """Sections of one GQA group (l2_section_bytes=1) and the tile and turn switches:
    every tile still computed once (reference), reruns bit-identical."""
    # bf16, so the default variant reuses test_sm90_persistent_numerics' builds
    q, k, v = _qkv(3, 777, 777, 12, 4, head_dim, torch.bfloat16, "cuda")
    s = pg.settings_for(head_dim, causal, persistent=True, l2_section_bytes=1,
                        **PERSISTENT_VARIANTS[variant])
    _settings_numerics(q, k, v, causal, s, reruns=1)
