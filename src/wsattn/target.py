"""Which machine a call runs on, as data the kernels' launch settings are computed from.

Kernels never branch on ``torch.cuda.get_device_capability()`` themselves: the launcher
asks :func:`target_of` once and passes the :class:`Target` to a settings function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# Targets the compile-only tooling knows (the evidence ladder, ``wsattn targets``).
KNOWN_CCS = {"sm_80": 80, "sm_90": 90, "sm_100": 100, "sm_103": 103, "sm_120": 120}


class UnsupportedTargetError(ValueError):
    """A kernel was asked to run on a target it has no code path for."""


@dataclass(frozen=True)
class Target:
    backend: str  # "cuda" or "interpreter" (TRITON_INTERPRET=1 on CPU tensors)
    cc: int  # compute capability as 90, 100, ...; 0 for the interpreter
    num_sms: int = 1

    @property
    def name(self) -> str:
        return "interpreter" if self.backend == "interpreter" else f"sm_{self.cc}"

    @property
    def has_tma(self) -> bool:
        return self.backend == "cuda" and self.cc >= 90

    @property
    def has_wgmma(self) -> bool:
        return self.backend == "cuda" and self.cc == 90


def interpreting() -> bool:
    """True when Triton kernels run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_CUDA_TARGETS: dict[int, Target] = {}  # device index -> Target: asked once per GPU


def target_of(device: torch.device) -> Target:
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = _CUDA_TARGETS.get(index)
        if target is None:  # the two property queries cost host time on every launch
            major, minor = torch.cuda.get_device_capability(index)
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            target = _CUDA_TARGETS[index] = Target("cuda", major * 10 + minor, sms)
        return target
    if interpreting() and device.type == "cpu":
        return Target("interpreter", 0, 4)
    raise UnsupportedTargetError(
        f"Triton kernels need CUDA tensors (or CPU tensors under TRITON_INTERPRET=1, the "
        f"Triton interpreter), got tensors on {device}; or pass impl='reference'"
    )


def parse_target(name: str) -> int:
    """'sm_90' -> 90, with an error naming the known targets otherwise."""
    if name not in KNOWN_CCS:
        raise UnsupportedTargetError(
            f"unknown target {name!r}; expected one of {', '.join(KNOWN_CCS)}")
    return KNOWN_CCS[name]
