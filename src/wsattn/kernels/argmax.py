"""Greedy decoding's argmax over the vocabulary, in two launches of many programs.

torch's ``logits.argmax(-1)`` over one [1, 128256] row runs as one reduction with little
parallelism: ~27 us on an H200 for 0.5 MB, 2 % of a Llama-3.2-1B decode step at B1
(notes/decode_step.md). Here each row is cut into CHUNK-wide chunks, one program a
(row, chunk) writes the chunk's best (value, index), and one program a row picks among
the chunks'. The result is torch's, bit for bit in meaning:

- the largest value, the lowest index among equal ones;
- a NaN counts as larger than everything (torch.argmax returns the first NaN's index);
- a row of -inf gives index 0.

Values are compared in fp32 (exact for fp16 / bf16 / fp32 inputs). No host reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..target import interpreting
from ._alloc import empty
from ._intmath import cdiv, next_pow2

CHUNK = 4096  # vocabulary entries a first-stage program reads: 32 programs a 128k row
WARPS = 4
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _best(v, idx, live, BIG: tl.constexpr):
    # (best value, its lowest index) over a block: a NaN beats everything and is returned
    # as NaN; idx of dead lanes never wins
    nan = (v != v) & live
    has_nan = tl.max(nan.to(tl.int32), 0)
    vmax = tl.max(tl.where(live & ~nan, v, float("-inf")), 0)
    cand = tl.where(has_nan > 0, nan, live & (v == vmax))
    i = tl.min(tl.where(cand, idx, BIG), 0)
    best = tl.where(has_nan > 0, float("nan"), vmax)
    return best, i


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_xm, C, CHUNK: tl.constexpr):
    # grid (rows, C): the best of row m's chunk c -> val[m, c], idx[m, c]
    m = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ptrs = x_ptr + m.to(tl.int64) * stride_xm + offs
    if (c + 1) * CHUNK <= V:
        # a whole chunk: no mask, so the loads can be 16 bytes wide (a mask against an
        # arbitrary V kept them 2 bytes wide in the sm_90 PTX)
        live = offs >= 0
        v = tl.load(ptrs).to(tl.float32)
    else:
        live = offs < V
        v = tl.load(ptrs, mask=live, other=float("-inf")).to(tl.float32)
    best, i = _best(v, offs, live, 2147483647)
    tl.store(val_ptr + m * C + c, best)
    tl.store(idx_ptr + m * C + c, i)


@triton.jit
def _row_kernel(val_ptr, idx_ptr, out_ptr, C, CB: tl.constexpr):
    # grid (rows,): the best of row m's C chunk winners -> out[m] (int64)
    m = tl.program_id(0)
    c = tl.arange(0, CB)
    live = c < C
    v = tl.load(val_ptr + m * C + c, mask=live, other=float("-inf"))
    i = tl.load(idx_ptr + m * C + c, mask=live, other=2147483647)
    # the chunks hold increasing index ranges, so the lowest index among equal values (or
    # among NaNs) is the lowest chunk's
    _, best = _best(v, i, live, 2147483647)
    tl.store(out_ptr + m, best.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the index of each row's largest value of ``logits`` [B, V] (float16,
    bfloat16 or float32, last dimension contiguous, on CUDA or under the Triton
    interpreter), as ``logits.argmax(-1)`` gives it (lowest index on ties, a NaN first).

    Example (TRITON_INTERPRET=1 on CPU, or CUDA tensors):
        >>> argmax(torch.tensor([[0.5, 2.0, 2.0, -1.0]]))
        tensor([1])
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a [B, V] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in DTYPES:
        raise TypeError(f"logits dtype must be one of {DTYPES}, got {logits.dtype}")
    B, V = logits.shape
    if V == 0:
        raise ValueError("logits has no entries to take the argmax of (V = 0)")
    if V > 2 ** 31 - 1 - CHUNK:
        # the chunk kernel's int32 (c + 1) * CHUNK must not wrap for the last chunk
        raise ValueError(f"logits has V = {V} entries; the kernel's int32 indices take at "
                         f"most 2**31 - 1 - {CHUNK}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits needs a contiguous last dimension, got strides "
                         f"{tuple(logits.stride())}")
    if logits.device.type != "cuda" and not (interpreting() and logits.device.type == "cpu"):
        raise ValueError(f"argmax runs on CUDA tensors (or the Triton interpreter), got "
                         f"logits on {logits.device}")
    out = empty((B,), torch.int64, logits.device)
    if B == 0:
        return out
    C = cdiv(V, CHUNK)
    val = empty((B, C), torch.float32, logits.device)
    idx = empty((B, C), torch.int32, logits.device)
    _chunk_kernel[(B, C)](logits, val, idx, V, logits.stride(0), C, CHUNK=CHUNK,
                          num_warps=WARPS)
    _row_kernel[(B,)](val, idx, out, C, CB=max(2, next_pow2(C)), num_warps=1)
    return out


def compile_spec(cc: int, dtype: str = "bf16", kernel: str = "chunk") -> dict:
    """What ``triton.compile`` needs to build the first-stage (``kernel="chunk"``) or the
    second-stage (``"row"``) kernel for compute capability cc, as decode_triton's
    compile_spec does (``ASTSource(fn, signature, constexprs, attrs)``)."""
    from ..testing import dtype_name
    if kernel == "chunk":
        sig = {"x_ptr": f"*{dtype_name(dtype)}", "val_ptr": "*fp32", "idx_ptr": "*i32",
               "V": "i32", "stride_xm": "i32", "C": "i32", "CHUNK": "constexpr"}
        const, fn, warps = {"CHUNK": CHUNK}, _chunk_kernel, WARPS
        aligned = ("x_ptr", "val_ptr", "idx_ptr", "stride_xm")
    elif kernel == "row":
        sig = {"val_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*i64", "C": "i32",
               "CB": "constexpr"}
        const, fn, warps = {"CB": 32}, _row_kernel, 1
        aligned = ("val_ptr", "idx_ptr", "out_ptr")
    else:
        raise ValueError(f"kernel must be 'chunk' or 'row', got {kernel!r}")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": sig, "constexprs": const, "attrs": attrs,
            "options": {"num_warps": warps}}
