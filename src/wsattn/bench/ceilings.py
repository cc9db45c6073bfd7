"""The ceilings every figure is reported against, measured in the same run.

* copy: device-to-device ``dst.copy_(src)`` of 1 GiB; bytes counted = read + written.
* matmul: bf16 ``torch.matmul`` at 8192^3 (cuBLAS); FLOP counted = 2 * n^3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cases import tbps, tflops
from .timing import Timing


@dataclass(frozen=True)
class Ceiling:
    name: str  # "copy" or "matmul"
    what: str
    timing: Timing
    value: float  # TB/s for copy, TFLOP/s for matmul
    unit: str


def copy_bandwidth(timer, device, nbytes: int = 1 << 30) -> Ceiling:
    src = torch.empty(nbytes // 4, dtype=torch.int32, device=device).random_(0, 1 << 30)
    dst = torch.empty_like(src)
    # An SM kernel (elementwise add of 0), not dst.copy_(src): a plain contiguous copy is a
    # cudaMemcpy, which runs on the copy engine (2.7 TB/s measured on H200) and is not the
    # ceiling a streaming kernel competes with (4.3 TB/s).
    t = timer(lambda: torch.add(src, 0, out=dst))
    return Ceiling("copy", f"device-to-device copy by an SM kernel, {nbytes >> 20} MiB, "
                   "read + written",
                   t, tbps(2.0 * nbytes, t.median_ms), "TB/s")


def matmul_rate(timer, device, n: int = 8192, dtype=torch.bfloat16) -> Ceiling:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = timer(lambda: torch.matmul(a, b, out=c))
    return Ceiling("matmul", f"{str(dtype).removeprefix('torch.')} matmul {n}^3 (torch)",
                   t, tflops(2.0 * n ** 3, t.median_ms), "TFLOP/s")


def measure(timer, device) -> dict[str, Ceiling]:
    return {c.name: c for c in (copy_bandwidth(timer, device), matmul_rate(timer, device))}


def _ceiling_rows(measure, name, timer, device, stamp) -> tuple[list[dict], float | None]:
    import sys

    from .report import ceiling_row
    try:
        ceiling = measure(timer, device)
    except Exception as e:  # fractions stay empty
        print(f"ceiling {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return [], None
    return [ceiling_row(stamp, ceiling)], ceiling.value


def copy_ceiling_rows(timer, device, stamp) -> tuple[list[dict], float | None]:
    """([the copy ceiling's row], its TB/s) for the decode-step benchmarks, measured in the
    same run as their rows; ([], None) with a message on stderr when it fails, so the
    rows are still measured, without their fractions of the ceiling."""
    return _ceiling_rows(copy_bandwidth, "copy", timer, device, stamp)


def matmul_ceiling_rows(timer, device, stamp) -> tuple[list[dict], float | None]:
    """([the matmul ceiling's row], its TFLOP/s) for the prefill-shaped benchmarks
    (chunked, varlen), as copy_ceiling_rows."""
    return _ceiling_rows(matmul_rate, "matmul", timer, device, stamp)
