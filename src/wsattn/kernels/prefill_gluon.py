"""sm_90 warp-specialized prefill in Gluon (issue 4). Placeholder until the kernel lands:
it qualifies for nothing, so impl="auto" takes the Triton kernel everywhere."""

from __future__ import annotations

import torch


def device_supported(device) -> bool:
    return False


def check_device(device) -> None:
    device = torch.device(device)
    cc = "cpu" if device.type != "cuda" else "sm_%d%d" % torch.cuda.get_device_capability(device)
    raise ValueError(f"impl='gluon' is not available on {cc}: the Gluon kernel is not built yet; "
                     "impl='triton' runs on sm_80, sm_90, sm_100 and sm_120")


def unsupported_reason(q, k, v, causal, varlen) -> str | None:
    return "the Gluon kernel is not built yet"
