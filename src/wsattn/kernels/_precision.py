"""The precision every Triton kernel of the library asks of tl.dot for fp32 operands, and
the range of the fp32 scalars the launchers pass them."""

import torch
import triton.language as tl

# 16-bit operands ignore it. Triton's default multiplies fp32 as one TF32 product (a 10-bit
# mantissa), which gave fp32 decode an LSE error of up to 4e-4 relative on the H200, past
# fp32's tolerance; three TF32 products (hi*hi + hi*lo + lo*hi) keep the tensor cores and
# about fp32's accuracy.
F32_DOT = tl.constexpr("tf32x3")

# Python floats reach the kernels as fp32 arguments: past FP32_MAX they are inf, below
# FP32_TINY (the smallest normal) they flush to zero, so an RMSNorm epsilon of 1e-50 would
# become 0 and a zero row rsqrt(0) * 0 = NaN.
FP32_TINY = float(torch.finfo(torch.float32).tiny)
FP32_MAX = float(torch.finfo(torch.float32).max)


def check_eps(name: str, eps, type_error=TypeError) -> None:
    """ValueError unless eps is > 0 in fp32's normal range; type_error (the module's
    convention) unless it is a float or int."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise type_error(f"{name} must be a float, got {eps!r}")
    if not FP32_TINY <= eps <= FP32_MAX:
        raise ValueError(f"{name} must be > 0 and in fp32's normal range "
                         f"[{FP32_TINY:.4e}, {FP32_MAX:.4e}], got {eps}")
