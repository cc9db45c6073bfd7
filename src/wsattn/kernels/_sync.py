"""Cross-program ordering for the "last program to arrive finishes" pattern (qkv_rope's
split-K sum, decode's fused split combine, moe's fused routing and combine): each
program's stores, a fence, a counter bump (``_arrive``); the program that sees the last
count fences again (``_acquire``) before reading the others' stores, and resets the
counter for the next launch."""

import triton
import triton.language as tl


@triton.jit
def _fence_acq_rel():
    # every thread's stores ordered before the counter bump (and the last program's loads
    # after it), as the CUDA threadFenceReduction pattern does
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _arrive(counter_ptr, FENCE: tl.constexpr):
    # counts this program in once all its threads' stores are ordered before it; returns
    # the count before this one (the last program of N to arrive sees N - 1). FENCE off:
    # the interpreter, which runs programs one after another and has no inline assembly.
    if FENCE:
        _fence_acq_rel()
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")


@triton.jit
def _acquire(FENCE: tl.constexpr):
    # the last program to arrive: the others' stores are visible to its loads after this
    if FENCE:
        _fence_acq_rel()
