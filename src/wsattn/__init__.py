"""wsattn: warp-specialized attention for LLM inference on NVIDIA Hopper and later.

Public API (validated, dispatching by ``impl=``):

* :func:`attention` - prefill over fixed-length batches ``[B, S, H, D]``
* :func:`attention_varlen` - prefill over packed variable-length sequences
* :func:`attention_paged` - chunked prefill of packed queries against a paged KV cache
* :func:`decode` - split-KV decode over a contiguous or paged KV cache
* :func:`merge_states` - merge partial (output, LSE) pairs
* :func:`generate` - text generation with a paged KV cache (:mod:`wsattn.engine`)

LSE convention everywhere: natural log, float32.
"""

from .api import attention, attention_paged, attention_varlen, decode, merge_states

__all__ = ["attention", "attention_varlen", "attention_paged", "decode", "merge_states",
           "generate"]
__version__ = "0.1.0"


def generate(*a, **k): from .engine.generate import generate as g; return g(*a, **k)  # noqa: E704  (lazy, so `import wsattn` stays light)
