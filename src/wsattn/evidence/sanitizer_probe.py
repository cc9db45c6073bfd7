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
"""

from __future__ import annotations

import os
import re
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


def build(workdir: str, nvcc: str = "nvcc") -> str:
    src, exe = os.path.join(workdir, "dispatch.cu"), os.path.join(workdir, "dispatch")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run([nvcc, "-arch=sm_90a", "-lineinfo", "-o", exe, src], check=True)
    return exe


def main(argv) -> int:
    from .sanitizer import find_tool
    out_dir = argv[0] if argv else tempfile.mkdtemp(prefix="wsattn-probe-")
    os.makedirs(out_dir, exist_ok=True)
    tool, why = find_tool()
    if tool is None:
        print(f"not run: {why}")
        return 2
    exe = build(out_dir)
    for i, mode in enumerate(MODES):
        log = os.path.join(out_dir, f"racecheck_{mode}.log")
        run = subprocess.run([tool, "--tool", "racecheck", "--racecheck-report", "all",
                              "--log-file", log, exe, str(i)], capture_output=True, text=True)
        text = open(log).read()
        summary = re.findall(r"RACECHECK SUMMARY:.*", text) or ["no summary"]
        hazard = re.findall(r"(?:Error|Warning): .*hazard.*", text)
        print(f"{mode:9s} exit {run.returncode}  {summary[-1]}  {hazard[0] if hazard else ''}  "
              f"| {run.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
