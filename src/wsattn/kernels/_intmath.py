"""Integer helpers for host code (launch grids, settings).

triton.cdiv and triton.next_power_of_2 are ConstexprFunctions: called from Python each
goes through Triton's constexpr unwrapping, ~3-5 us of host time a call (cProfile on the
CPU), and one decode step made ten such calls. Launch paths use these instead; kernels
keep tl.cdiv.
"""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative a by positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
