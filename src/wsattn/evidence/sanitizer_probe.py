"""Does racecheck model a named barrier? The control for the Gluon prefill's RAW report.

``python -m wsattn.evidence.sanitizer_probe [OUT_DIR]`` builds (nvcc) one CUDA kernel
that copies gl.warp_specialize's dispatch as Triton 3.6 lowers it (notes/sanitizer.md):
384 threads; the four default warps all store a state word to shared memory, then every
thread synchronizes, then the eight worker warps each read their byte. It runs the kernel
under ``compute-sanitizer --tool racecheck`` with four synchronizations between the store
and the reads:

  bar0       ``bar.sync 0`` (``__syncthreads``)               correct
  bar1       ``barrier.sync 1`` (Triton's form, whole CTA)   correct
  bar1_384   ``bar.sync 1, 384``                            correct
  none       nothing                                         a real race (positive control)

Then the same handoff shaped like the kernel (``ws``: 384 threads, the default warps'
``st.shared.v2.b32`` of one byte per worker warp, workers reading theirs after a
``barrier.sync 1``, a second round that sends every worker the exit code; each write/read
pair ordered by whole-CTA ``barrier.sync 1``), alone, with each of :data:`FEATURES`
(setmaxnreg, ``bar.sync 0, 128``, ``bar.sync 2, 128``, ``ret`` on exit, ``brx.idx``, the
loop) and with all of them (``ws_all``). Every ws variant is correctly ordered: a RAW
hazard racecheck reports there is its own false positive, and names the feature it
mis-models. The program prints its array's shared address; ``none``'s hazards give the
offset racecheck adds to shared offsets (:func:`shared_offset`).

It prints one line per variant with racecheck's summary. If a correctly ordered variant
reports the hazard that bar0 does not, the Gluon report on those bytes is no evidence.
The result also goes to ``OUT_DIR/probe.json``; the ladder's sanitizer gate runs
:func:`run` once per ladder run and waives the Gluon dispatch hazard only when
:func:`supports_waiver` holds (notes/sanitizer.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

MODES = ("bar0", "bar1", "bar1_384", "none")

# The kernel-shaped handoff (``ws<F>`` in SOURCE): the lowering's two dispatch rounds with
# every write/read pair ordered by a whole-CTA ``barrier.sync 1``, plus the features below,
# one at a time and all together, each compiled as its own kernel. Bits match SOURCE's F_*.
FEATURES = {
    "setmaxnreg": 1,  # (a) setmaxnreg.dec/inc.sync.aligned between the barriers, as the kernel has them
    "bar0_128": 2,    # (b) bar.sync 0, 128 among the 4 default warps (barrier 0 with a partial count)
    "bar2_128": 4,    # (c) bar.sync 2, 128 among the 4 consumer worker warps (4-7)
    "exit": 8,        # (d) workers ret on code 4 while the default still does barrier.sync 1
    "brx": 16,        # (e) the worker's ld.shared.b8 + brx.idx dispatch, as inline PTX
    "loop": 32,       # (f) workers loop back to the head; otherwise two unrolled rounds
}
WS_VARIANTS = {"ws": (), **{f"ws+{f}": (f,) for f in FEATURES}, "ws_all": tuple(FEATURES)}
VARIANTS = MODES + tuple(WS_VARIANTS)
# the probe's own dispatch bytes: its one __shared__ array, so its offsets are 0..7 in the
# kernel's static shared memory; worker warp w (4..11) reads byte w - 4
STATE_BYTES, DEFAULT_WARPS = 8, 4


def variant_features(name: str) -> frozenset:
    """The kernel features a probe variant has (the simple controls have none:
    ``bar.sync 1, 384`` is the same whole-CTA barrier 1 as ``barrier.sync 1``)."""
    return frozenset(WS_VARIANTS.get(name, ()))


def _flags(name: str) -> int:
    return sum(FEATURES[f] for f in WS_VARIANTS[name])


SOURCE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
__global__ void __launch_bounds__(384, 1) dispatch(int mode, unsigned char *out, unsigned *where) {
  __shared__ __align__(8) unsigned char state[8];  // one byte per worker warp (warps 4..11)
  unsigned warp = threadIdx.x / 32;
  if (threadIdx.x == 0 && blockIdx.x == 0) *where = (unsigned)__cvta_generic_to_shared(state);
  if (warp < 4)  // every thread of the default warp group stores the same word, as Triton does
    *reinterpret_cast<volatile unsigned long long *>(state) = 0x0301020200000000ull;
  if (mode == 0) asm volatile("bar.sync 0;" ::: "memory");
  if (mode == 1) asm volatile("barrier.sync 1;" ::: "memory");
  if (mode == 2) asm volatile("bar.sync 1, 384;" ::: "memory");
  if (warp >= 4) out[blockIdx.x * 8 + warp - 4] = reinterpret_cast<volatile unsigned char *>(state)[warp - 4];
}

#define F_SETMAXNREG 1
#define F_BAR0 2
#define F_BAR2 4
#define F_EXIT 8
#define F_BRX 16
#define F_LOOP 32
#define B1() asm volatile("barrier.sync 1;" ::: "memory")
#define NREG(op, n) do { if (F & F_SETMAXNREG) asm volatile("setmaxnreg." #op ".sync.aligned.u32 " #n ";" ::: "memory"); } while (0)
#define BAR0() do { if (F & F_BAR0) asm volatile("bar.sync 0, 128;" ::: "memory"); } while (0)
#define BAR2() do { if (F & F_BAR2) asm volatile("bar.sync 2, 128;" ::: "memory"); } while (0)

// The worker's read of its dispatch byte, the lowering's ld.shared.b8 at base + warp.
template <int F> __device__ __forceinline__ unsigned read_code(unsigned addr) {
  unsigned code;
  if (F & F_BRX) {
    // ld + brx.idx to one target per code, as the lowering dispatches
    asm volatile("{\n\t.reg .u32 c;\n\t.reg .pred p;\n\t"
                 "ld.shared.u8 c, [%1];\n\tsetp.gt.u32 p, c, 4;\n\t@p bra.uni Lx;\n\t"
                 "Lt: .branchtargets L0, L1, L2, L3, L4;\n\tbrx.idx c, Lt;\n\t"
                 "L0: mov.u32 %0, 0; bra.uni Ld;\n\tL1: mov.u32 %0, 1; bra.uni Ld;\n\t"
                 "L2: mov.u32 %0, 2; bra.uni Ld;\n\tL3: mov.u32 %0, 3; bra.uni Ld;\n\t"
                 "L4: mov.u32 %0, 4; bra.uni Ld;\n\tLx: mov.u32 %0, 5;\n\tLd:\n\t}"
                 : "=r"(code) : "r"(addr) : "memory");
  } else {
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(code) : "r"(addr) : "memory");
  }
  return code;
}

// One worker round after its read: the partition for its code, between two barrier.sync 1
// (the default's 2nd and 3rd). Code 0: a 4-warp consumer (warps 4-7, bar.sync 2, 128);
// 1: a 1-warp partition; 2, 3: idle.
template <int F> __device__ __forceinline__ void worker_case(unsigned code, unsigned *out) {
  if (code == 0) {
    NREG(inc, 240); B1();
    BAR2(); out[threadIdx.x] += 1; BAR2();
    B1(); NREG(dec, 120);
  } else if (code == 1) {
    NREG(dec, 24); B1();
    out[threadIdx.x] += 2;
    B1(); NREG(inc, 120);
  } else {
    NREG(dec, 24); B1(); B1(); NREG(inc, 120);
  }
}

// A worker's loop head: setmaxnreg.dec 120; barrier.sync 1; read the byte (R1, then R2 = exit).
template <int F> __device__ __forceinline__ unsigned worker_head(unsigned addr) {
  NREG(dec, 120); B1();
  return read_code<F>(addr);
}

// __maxnreg__(168), not __launch_bounds__(384, 1) (nvcc refuses both): ptxas then
// allocates 168 = the .maxnreg of Triton's kernel, the pool setmaxnreg redistributes
template <int F> __global__ void __maxnreg__(168) ws(unsigned *out, unsigned *where) {
  __shared__ __align__(8) unsigned char state[8];  // the only shared array: offsets 0..7
  unsigned warp = threadIdx.x / 32;
  unsigned base = (unsigned)__cvta_generic_to_shared(state);
  if (threadIdx.x == 0 && blockIdx.x == 0) *where = base;
  if (warp < 4) {
    // default: W1 (warps 4-7: 0, 8: 2, 9: 2, 10: 1, 11: 3), B, B, partition, B, W2 (all 4: exit), B
    NREG(inc, 256);
    BAR0();
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(base), "n"(0), "n"(50397698) : "memory");
    B1(); NREG(dec, 240); B1();
    BAR0(); out[threadIdx.x] += 3; BAR0();
    B1(); NREG(inc, 256);
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(base), "n"(67372036), "n"(67372036) : "memory");
    B1();
    if (!(F & F_EXIT)) B1();  // without the early exit, everyone meets once more before leaving
    return;
  }
  unsigned addr = base + warp - 4, code;
  if (F & F_LOOP) {
    for (;;) {
      code = worker_head<F>(addr);
      out[384 + blockIdx.x * 16 + warp] = code;
      if (code >= 4) break;
      worker_case<F>(code, out);
    }
  } else {
#pragma unroll
    for (int round = 0; round < 2; ++round) {
      code = worker_head<F>(addr);
      out[384 + blockIdx.x * 16 + warp] = code;
      if (code >= 4) break;
      worker_case<F>(code, out);
    }
  }
  if (F & F_EXIT) asm volatile("ret;");
  B1();
}

typedef void (*ws_kernel)(unsigned *, unsigned *);
static const struct { const char *name; ws_kernel k; } WS[] = {
@WS_TABLE@
};

int main(int argc, char **argv) {
  // argv[1]: a MODES index (0-3: the simple controls) or a ws variant's name
  unsigned *where, *out, h_where = 0;
  cudaMalloc(&where, 4);
  cudaMalloc(&out, 4096 * 4);
  cudaMemset(out, 0, 4096 * 4);
  const char *name = argv[1];
  int mode = -1;
  for (int i = 0; i < 4; ++i) if (name[0] == '0' + i && !name[1]) mode = i;
  if (mode >= 0) {
    dispatch<<<2, 384>>>(mode, reinterpret_cast<unsigned char *>(out), where);
  } else {
    int found = 0;
    for (unsigned i = 0; i < sizeof(WS) / sizeof(WS[0]); ++i)
      if (!strcmp(WS[i].name, name)) { WS[i].k<<<2, 384>>>(out, where); found = 1; }
    if (!found) { printf("unknown variant %s\n", name); return 2; }
  }
  cudaError_t e = cudaDeviceSynchronize();
  unsigned h[1024];
  cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
  cudaMemcpy(&h_where, where, 4, cudaMemcpyDeviceToHost);
  printf("mode %s: %s; state at shared 0x%x;", name, cudaGetErrorString(e), h_where);
  if (mode >= 0) {
    printf(" warp 4..11 read");
    for (int i = 0; i < 8; ++i) printf(" %d", reinterpret_cast<unsigned char *>(h)[i]);
  } else {
    printf(" warp 4..11 last code");
    for (int w = 4; w < 12; ++w) printf(" %u", h[384 + w]);
  }
  printf("\n");
  return e != cudaSuccess;
}
"""


def source() -> str:
    """SOURCE with one ``ws<F>`` instance per ws variant in its table."""
    rows = ",\n".join(f'  {{"{n}", ws<{_flags(n)}>}}' for n in WS_VARIANTS)
    return SOURCE.replace("@WS_TABLE@", rows)


def build_command(nvcc: str, src: str, exe: str) -> list:
    # sm_90a: setmaxnreg needs it
    return [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-o", exe, src]


def find_nvcc(env: dict | None = None) -> str | None:
    import glob
    import shutil
    env = os.environ if env is None else env
    path = shutil.which("nvcc", path=env.get("PATH"))
    if path:
        return path
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    for c in ([os.path.join(home, "bin", "nvcc")] if home else []) + \
            ["/usr/local/cuda/bin/nvcc", *sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), reverse=True)]:
        if os.access(c, os.X_OK):
            return c
    return None


def build(workdir: str, nvcc: str = "nvcc") -> str:
    src, exe = os.path.join(workdir, "dispatch.cu"), os.path.join(workdir, "dispatch")
    with open(src, "w") as f:
        f.write(source())
    subprocess.run(build_command(nvcc, src, exe), check=True, capture_output=True, text=True)
    return exe


def run(out_dir: str | None = None, tool: str | None = None, timeout: float = 120.0) -> dict:
    """Build the control and run each mode under racecheck; never raises. Returns
    ``{"modes": {mode: {...}}, "supports_waiver": bool, "line": str}`` or, when it could not
    run, ``{"error", "supports_waiver": False, "line"}``."""
    from .sanitizer import find_tool
    out_dir = out_dir or tempfile.mkdtemp(prefix="wsattn-probe-")
    os.makedirs(out_dir, exist_ok=True)
    if tool is None:
        tool, why = find_tool()
        if tool is None:
            return _done(out_dir, {"error": why})
    nvcc = find_nvcc()
    if nvcc is None:
        return _done(out_dir, {"error": "nvcc not found"})
    try:
        exe = build(out_dir, nvcc)
    except subprocess.CalledProcessError as e:
        return _done(out_dir, {"error": f"nvcc failed: {(e.stderr or '').strip()[-300:]}"})
    except OSError as e:
        return _done(out_dir, {"error": f"nvcc failed: {e}"})
    modes = {}
    for i, mode in enumerate(VARIANTS):
        log = os.path.join(out_dir, f"racecheck_{mode}.log")
        arg = str(i) if mode in MODES else mode
        try:
            p = subprocess.run([tool, "--tool", "racecheck", "--racecheck-report", "all",
                                "--log-file", log, exe, arg], capture_output=True, text=True,
                               timeout=timeout)
            rc, stdout = p.returncode, p.stdout.strip()
        except subprocess.TimeoutExpired:
            rc, stdout = None, f"timed out after {timeout:.0f} s"
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        modes[mode] = mode_result(arg, text, rc, stdout)
    return _done(out_dir, {"modes": modes})


def mode_result(arg: str, text: str, rc, stdout: str) -> dict:
    """One variant's racecheck log and program output, as probe.json keeps it."""
    from .sanitizer import parse
    r = parse("racecheck", text, rc)
    found = r.get("findings", [])
    return {"returncode": rc, "stdout": stdout, "hazards": r.get("hazards"),
            "race_errors": r.get("race_errors"), "warnings": r.get("warnings"),
            "kinds": sorted({h["kind"] for h in found}),
            # racecheck counts each "Race reported" summary line as a hazard too
            "race_reports": len(r.get("races", [])),
            # each hazard's address and the warps on either side, for the offset and the
            # check that a variant's hazards are on its own dispatch bytes
            "at": [{"addr": h["addr"], "kind": h["kind"], "level": h["level"],
                    "read_warps": sorted({x[1] // 32 for x in h["accesses"] if x[0] == "Read"}),
                    "write_warps": sorted({x[1] // 32 for x in h["accesses"] if x[0] == "Write"})}
                   for h in found[:200]],
            "features": sorted(variant_features(arg if arg in WS_VARIANTS else "")),
            # the kernel ran to the end and read back (a crash is no evidence)
            "ran": f"mode {arg}: no error" in stdout}


def shared_offset(probe: dict | None) -> int | None:
    """The offset racecheck adds to a kernel's shared-memory offsets on this machine, learned
    from the probe's positive control: in ``none`` every hazard is on byte ``w - 4`` of the
    probe's one __shared__ array (offset 0), w the reading worker warp, so its address minus
    that byte is the offset. None unless every such hazard agrees (then nothing is learned)."""
    x = ((probe or {}).get("modes") or {}).get("none") or {}
    if not x.get("ran") or not x.get("at"):
        return None
    seen = set()
    for h in x["at"]:
        reads = [w for w in h.get("read_warps", []) if DEFAULT_WARPS <= w < DEFAULT_WARPS + STATE_BYTES]
        if len(reads) != 1:
            return None
        seen.add(h["addr"] - (reads[0] - DEFAULT_WARPS))
    return seen.pop() if len(seen) == 1 and min(seen) >= 0 else None


def _on_state(x: dict, offset: int | None) -> bool:
    """Every hazard of variant ``x`` is a RAW Error on the probe's dispatch bytes, read by the
    worker warp whose byte it is and written by a default warp."""
    # every hazard racecheck counted must be read: the hazards plus its race-report lines
    if offset is None or not x.get("at") or "race_reports" not in x \
            or len(x["at"]) + x["race_reports"] != x.get("hazards"):
        return False
    for h in x["at"]:
        byte = h["addr"] - offset
        if h["kind"] != "RAW" or not 0 <= byte < STATE_BYTES:
            return False
        if h.get("read_warps") != [byte + DEFAULT_WARPS] or \
                any(w >= DEFAULT_WARPS for w in h.get("write_warps", [])):
            return False
    return True


def supports_waiver(probe: dict | None, features=frozenset()) -> tuple[bool, str]:
    """(racecheck demonstrably reports a hazard for a barrier-1-ordered handoff that it
    does not report under bar.sync 0, the line that says what the probe showed).

    A supporting variant is one whose features (:func:`variant_features`) are a subset of
    ``features``, the kernel's (``sanitizer.dispatch_bytes``): it ran, racecheck reported
    a RAW error for it, and, when the probe has per-hazard addresses, every one of its
    hazards lies on its own dispatch bytes at the offset learned from ``none``. A report
    racecheck also gives for a provably ordered control with only features the kernel has
    is not evidence of a race in the kernel. bar.sync 0 must be clean (racecheck orders
    a plain __syncthreads here) in every case."""
    if not probe:
        return False, "probe: not run"
    if probe.get("error"):
        return False, f"probe: not run: {probe['error']}"
    m = probe.get("modes") or {}
    features = frozenset(features or ())

    def say(mode):
        x = m.get(mode) or {}
        if x.get("hazards") is None:
            return f"{mode} no summary"
        kinds = "/".join(x.get("kinds") or [])
        return f"{mode} {x['hazards']} hazard(s){' ' + kinds if kinds else ''}" + ("" if x.get("ran") else " (did not run)")

    line = "probe: " + ", ".join(say(k) for k in VARIANTS if k in m)
    offset = shared_offset(probe)
    if offset is not None:
        line += f"; racecheck shared offset {offset:#x}"
    b0 = m.get("bar0") or {}
    if not (b0.get("ran") and b0.get("hazards") == 0 and b0.get("race_errors") == 0):
        return False, line + "; bar.sync 0 not clean: does not show a barrier-1 false positive: nothing waived"

    def supports(name):
        x = m.get(name) or {}
        if not (x.get("ran") and (x.get("race_errors") or 0) >= 1 and "RAW" in (x.get("kinds") or [])):
            return False
        if not variant_features(name) <= features:
            return False
        # old probe results carry no addresses; any that do must be on the probe's bytes
        return "at" not in x or _on_state(x, offset)

    who = [k for k in VARIANTS if k not in ("bar0", "none") and supports(k)]
    if who:
        feats = sorted(frozenset.intersection(*(frozenset(variant_features(k)) for k in who)))
        return True, line + (f"; racecheck flags the barrier.sync 1 handoff, which it orders alone, once "
                             f"the control has {'+'.join(feats) or 'no extra feature'} "
                             f"({', '.join(who)}): a false positive on this machine")
    return False, line + "; does not show a barrier-1 false positive: nothing waived"


def _done(out_dir, result):
    result["supports_waiver"], result["line"] = supports_waiver(result)
    # what a kernel with every feature (the Gluon prefill's dispatch) could be waived on
    result["supports_waiver_all_features"], result["line_all_features"] = \
        supports_waiver(result, frozenset(FEATURES))
    result["shared_offset"] = shared_offset(result)
    result["out_dir"] = out_dir
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv) -> int:
    r = run(argv[0] if argv else None)
    if r.get("error"):
        print(f"not run: {r['error']}")
        return 2
    for mode, x in r["modes"].items():
        print(f"{mode:16s} exit {x['returncode']}  hazards {x['hazards']} ({x['race_errors']} errors, "
              f"{x['warnings']} warnings) {'/'.join(x['kinds'])}  | {x['stdout']}")
    print(r["line"])
    print("with every kernel feature: " + r["line_all_features"])
    print(f"json: {os.path.join(r['out_dir'], 'probe.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
