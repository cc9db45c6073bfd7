"""Cross-program ordering for the "last program to arrive finishes" pattern (qkv_rope's
split-K sum, moe's fused routing): each program's stores, a fence, a counter bump; the
program that sees the last count fences again before reading the others' stores."""

import triton
import triton.language as tl


@triton.jit
def _fence_acq_rel():
    # every thread's stores ordered before the counter bump (and the last program's loads
    # after it), as the CUDA threadFenceReduction pattern does
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)
