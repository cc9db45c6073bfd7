"""wsattn: warp-specialized attention for LLM inference on NVIDIA Hopper and later.

Public API (validated, dispatching by ``impl=``):

* :func:`attention` - prefill over fixed-length batches ``[B, S, H, D]``
* :func:`attention_varlen` - prefill over packed variable-length sequences
* :func:`decode` - split-KV decode over a contiguous or paged KV cache
* :func:`merge_states` - merge partial (output, LSE) pairs

LSE convention everywhere: natural log, float32.
"""

from .api import attention, attention_varlen, decode, merge_states

__all__ = ["attention", "attention_varlen", "decode", "merge_states"]
__version__ = "0.1.0"
