"""Why racecheck's RAW hazard on the Gluon prefill is a false report (notes/sanitizer.md):
the bytes are gl.warp_specialize's per-warp state, written by the default warp group and
read by the worker warps, and every write/read pair is ordered by `barrier.sync 1` with
no thread count, which every thread of the CTA (all 12 warps) waits on."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def build():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from wsattn.kernels import prefill_gluon as pg
    spec = pg.compile_spec(cc=90, head_dim=128, dtype="bf16", causal=False)
    src = GluonASTSource(spec["fn"], spec["signature"], spec["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])


def _state_offsets(ptx):
    """(where workers read their state byte, where the default group writes the bytes)."""
    reads = re.findall(r"ld\.shared\.b8\s+%r\d+, \[%r\d+\+(\d+)\];", ptx)
    writes = re.findall(r"st\.shared\.v2\.b32\s+\[global_smem\+(\d+)\]", ptx)
    return sorted({int(x) for x in reads}), sorted({int(x) for x in writes})


def test_state_bytes_are_the_last_bytes_of_shared_memory_and_only_the_dispatch_touches_them(build):
    """The state is one byte per worker warp after every buffer and mbarrier of the kernel."""
    ptx, md = build.asm["ptx"], build.metadata
    (read_base,), (write_at,) = _state_offsets(ptx)
    default_warps = 4
    workers = md.num_warps - default_warps
    # worker warp w reads [read_base + w], w = 4..11: exactly the bytes written
    assert read_base + default_warps == write_at and md.shared == write_at + workers
    touching = [ln for ln in ptx.splitlines()
                if re.search(rf"global_smem\+{write_at}\b", ln)]
    assert len(touching) == 2 and all("st.shared.v2.b32" in ln for ln in touching), touching


def test_every_state_write_and_read_is_fenced_by_a_whole_cta_barrier_1(build):
    lines = [ln.strip() for ln in build.asm["ptx"].splitlines()]
    (read_base,), (write_at,) = _state_offsets(build.asm["ptx"])
    reads = [i for i, ln in enumerate(lines) if re.match(rf"ld\.shared\.b8 .*\+{read_base}\];", ln)]
    writes = [i for i, ln in enumerate(lines) if f"[global_smem+{write_at}]" in ln]
    assert len(reads) == 1 and len(writes) == 2
    # the reader: the loop head waits on barrier 1, then reads its byte
    prev = next(ln for ln in reversed(lines[:reads[0]]) if "bar" in ln and "mbarrier" not in ln)
    assert prev == "barrier.sync \t1;", prev
    for w in writes:  # the writer: the next barrier after the store is barrier 1
        nxt = next(ln for ln in lines[w + 1:] if "bar" in ln and "mbarrier" not in ln)
        assert nxt == "barrier.sync \t1;", nxt
    # barrier 1 never takes a thread count and is never arrived on without waiting:
    # `barrier.sync 1` counts every thread of the CTA (12 warps, 384 threads here)
    assert not [ln for ln in lines if re.match(r"(bar|barrier)\.(sync|arrive|red)\S*\s+1\s*,", ln)]
    assert build.metadata.num_warps == 12


def test_sass_barrier_1_has_no_thread_count(build):
    """ptxas keeps it whole-CTA: BAR.SYNC 0x1 with no count, right before the LDS.U8 of
    the dispatch and the next barrier after each STS.64 of the state."""
    from wsattn.evidence.compile_gate import sass_listing
    sass = [re.sub(r"^-\s*", "", ln).strip() for ln in sass_listing(build.asm["cubin"]).splitlines()]
    sass = [ln for ln in sass if ln]
    assert not [ln for ln in sass if re.search(r"\bBAR\.\S+ 0x1,", ln)]  # never a counted barrier 1
    lds = [i for i, ln in enumerate(sass) if ln.startswith("LDS.U8")]
    assert len(lds) == 1 and sass[lds[0] - 1] == "BAR.SYNC.DEFER_BLOCKING 0x1;", sass[lds[0] - 2:lds[0] + 1]
    stores = [i for i, ln in enumerate(sass) if ln.startswith("STS.64") and "0x38158]" in ln]
    assert len(stores) == 2
    for i in stores:
        nxt = next(ln for ln in sass[i + 1:] if re.search(r"\b(BAR|BRA|EXIT|BRX)\b", ln))
        assert nxt == "BAR.SYNC.DEFER_BLOCKING 0x1;", nxt


def test_the_gate_derives_the_dispatch_bytes_and_codes_from_the_compiled_kernel(build):
    """What the sanitizer gate's waiver reads (wsattn.evidence.sanitizer.dispatch_bytes):
    the range from metadata.shared and the worker warp count, cross-checked with the PTX,
    and the codes each byte can hold from the default group's two stores."""
    from wsattn.evidence import sanitizer
    md = build.metadata
    ws = sanitizer.dispatch_bytes(build.asm["ptx"], md.shared, md.num_warps, 4)
    assert "error" not in ws, ws
    assert (ws["lo"], ws["hi"], ws["workers"]) == (md.shared - 8, md.shared, 8)
    assert ws["read_base"] + 4 == ws["lo"]
    codes = {int(a) - ws["lo"] + 4: v for a, v in ws["values"].items()}  # by worker warp
    assert codes == {4: [0, 4], 5: [0, 4], 6: [0, 4], 7: [0, 4], 8: [2, 4], 9: [2, 4], 10: [1, 4],
                     11: [3, 4]}
    # a wrong default-warp count does not find the worker read: nothing could be waived
    assert "error" in sanitizer.dispatch_bytes(build.asm["ptx"], md.shared, md.num_warps, 2)
