"""The precision every Triton kernel of the library asks of tl.dot for fp32 operands."""

import triton.language as tl

# 16-bit operands ignore it. Triton's default multiplies fp32 as one TF32 product (a 10-bit
# mantissa), which gave fp32 decode an LSE error of up to 4e-4 relative on the H200, past
# fp32's tolerance; three TF32 products (hi*hi + hi*lo + lo*hi) keep the tensor cores and
# about fp32's accuracy.
F32_DOT = tl.constexpr("tf32x3")
