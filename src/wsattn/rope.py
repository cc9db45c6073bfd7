"""Rotary-embedding frequencies, written once for the reference model and the kernels.

The host computes the inverse frequencies [D/2] once per model; the reference rotates with
them in PyTorch and the fused QKV kernel forms cos/sin from them in registers. Both follow
transformers' convention (rotate_half pairs channel i with i + D/2; cos/sin of the D/2
frequencies concatenated with themselves) and its float32 arithmetic, bit for bit.
"""

from __future__ import annotations

import math

import torch

__all__ = ["rope_inv_freq"]


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  *, device=None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, fp32 [head_dim / 2], computed with
    transformers' float32 arithmetic (``_compute_default_rope_parameters`` /
    ``_compute_llama3_parameters`` in ``transformers.modeling_rope_utils``), bit for bit.

    scaling: None or {"rope_type": "default"} for plain RoPE; Llama-3 frequency scaling as
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} (a config's ``rope_parameters``; "type" is accepted
    for "rope_type"). Any other rope type is refused by name.

    Example:
        >>> inv = rope_inv_freq(128, 500000.0, {"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        ...     "original_max_position_embeddings": 8192})
        >>> inv.shape, inv.dtype
        (torch.Size([64]), torch.float32)
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 \
            or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) \
            or not 0 < theta <= torch.finfo(torch.float32).max:
        # (computed in fp32 as transformers computes it: past fp32's range theta is inf)
        raise ValueError(f"theta must be a positive number within fp32's range, got {theta!r}")
    rope_type = "default"
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise ValueError(f"scaling must be a dict or None, got {type(scaling).__name__}")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"scaling: rope type {rope_type!r} is not supported (only 'default' "
                         "and 'llama3')")
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float)
                                / dim))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ValueError(f"scaling: llama3 rope needs {', '.join(missing)}")
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        if high_freq_factor == low_freq_factor:
            raise ValueError("scaling: high_freq_factor must differ from low_freq_factor")
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = ((old_context_len / wavelen - low_freq_factor)
                         / (high_freq_factor - low_freq_factor))
        smoothed_inv_freq = ((1 - smooth_factor) * inv_freq_llama / factor
                             + smooth_factor * inv_freq_llama)
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq.to(device) if device is not None else inv_freq
