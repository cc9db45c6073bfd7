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

and prints one line per mode with racecheck's summary. If bar1 reports the hazard that
bar0 does not, racecheck does not model the named barrier and the Gluon report is false.
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

SOURCE = r"""
#include <cstdio>
#include <cstdlib>
__global__ void __launch_bounds__(384, 1) dispatch(int mode, unsigned char *out) {
  __shared__ __align__(8) unsigned char state[8];  // one byte per worker warp (warps 4..11)
  unsigned warp = threadIdx.x / 32;
  if (warp < 4)  // every thread of the default warp group stores the same word, as Triton does
    *reinterpret_cast<volatile unsigned long long *>(state) = 0x0301020200000000ull;
  if (mode == 0) asm volatile("bar.sync 0;" ::: "memory");
  if (mode == 1) asm volatile("barrier.sync 1;" ::: "memory");
  if (mode == 2) asm volatile("bar.sync 1, 384;" ::: "memory");
  if (warp >= 4) out[blockIdx.x * 8 + warp - 4] = reinterpret_cast<volatile unsigned char *>(state)[warp - 4];
}
int main(int argc, char **argv) {
  int mode = atoi(argv[1]);
  unsigned char *out;
  cudaMalloc(&out, 16);
  dispatch<<<2, 384>>>(mode, out);
  cudaError_t e = cudaDeviceSynchronize();
  unsigned char h[16];
  cudaMemcpy(h, out, 16, cudaMemcpyDeviceToHost);
  printf("mode %d: %s; warp 4..11 read", mode, cudaGetErrorString(e));
  for (int i = 0; i < 8; ++i) printf(" %d", h[i]);
  printf("\n");
  return e != cudaSuccess;
}
"""


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
        f.write(SOURCE)
    subprocess.run([nvcc, "-arch=sm_90a", "-lineinfo", "-o", exe, src], check=True,
                   capture_output=True, text=True)
    return exe


def run(out_dir: str | None = None, tool: str | None = None, timeout: float = 120.0) -> dict:
    """Build the control and run each mode under racecheck; never raises. Returns
    ``{"modes": {mode: {...}}, "supports_waiver": bool, "line": str}`` or, when it could not
    run, ``{"error", "supports_waiver": False, "line"}``."""
    from .sanitizer import find_tool, parse
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
    for i, mode in enumerate(MODES):
        log = os.path.join(out_dir, f"racecheck_{mode}.log")
        try:
            p = subprocess.run([tool, "--tool", "racecheck", "--racecheck-report", "all",
                                "--log-file", log, exe, str(i)], capture_output=True, text=True,
                               timeout=timeout)
            rc, stdout = p.returncode, p.stdout.strip()
        except subprocess.TimeoutExpired:
            rc, stdout = None, f"timed out after {timeout:.0f} s"
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        r = parse("racecheck", text, rc)
        modes[mode] = {"returncode": rc, "stdout": stdout, "hazards": r.get("hazards"),
                       "race_errors": r.get("race_errors"), "warnings": r.get("warnings"),
                       "kinds": sorted({h["kind"] for h in r.get("findings", [])}),
                       # the kernel ran to the end and read back (a crash is no evidence)
                       "ran": f"mode {i}: no error" in stdout}
    return _done(out_dir, {"modes": modes})


def supports_waiver(probe: dict | None) -> tuple[bool, str]:
    """(racecheck demonstrably reports a hazard for a barrier-1-ordered handoff that it
    does not report under bar.sync 0, the line that says what the probe showed)."""
    if not probe:
        return False, "probe: not run"
    if probe.get("error"):
        return False, f"probe: not run: {probe['error']}"
    m = probe.get("modes") or {}

    def say(mode):
        x = m.get(mode) or {}
        if x.get("hazards") is None:
            return f"{mode} no summary"
        kinds = "/".join(x.get("kinds") or [])
        return f"{mode} {x['hazards']} hazard(s){' ' + kinds if kinds else ''}" + ("" if x.get("ran") else " (did not run)")

    line = "probe: " + ", ".join(say(k) for k in MODES if k in m)
    b0, b1 = m.get("bar0") or {}, m.get("bar1") or {}
    ok = (b0.get("ran") and b0.get("hazards") == 0 and b0.get("race_errors") == 0
          and b1.get("ran") and (b1.get("race_errors") or 0) >= 1 and "RAW" in (b1.get("kinds") or []))
    return bool(ok), line + ("; racecheck flags the barrier.sync 1 handoff and not bar.sync 0: "
                             "false positive on this machine" if ok else
                             "; does not show a barrier-1 false positive: nothing waived")


def _done(out_dir, result):
    result["supports_waiver"], result["line"] = supports_waiver(result)
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
        print(f"{mode:9s} exit {x['returncode']}  hazards {x['hazards']} ({x['race_errors']} errors, "
              f"{x['warnings']} warnings) {'/'.join(x['kinds'])}  | {x['stdout']}")
    print(r["line"])
    print(f"json: {os.path.join(r['out_dir'], 'probe.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
