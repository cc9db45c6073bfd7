"""Gate 3: one launch on a GPU whose compute capability equals the target.

Anything else is "not run: no sm_XX device here", never a pass: a kernel compiled for
sm_100 has not been shown to launch by an H200 (or by a CPU).
"""

from __future__ import annotations

import random


def device_cc() -> int | None:
    """Compute capability of CUDA device 0 as 90, 100, ...; None without a GPU."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(0)
        return major * 10 + minor
    except Exception:
        return None


def not_here(cc: int) -> str | None:
    """Why gates 3-7 cannot run for target sm_cc on this machine, or None if they can."""
    here = device_cc()
    if here == cc:
        return None
    return f"no sm_{cc} device here" + (f", this machine has sm_{here}" if here else "")


def run_launch(spec, seed: int = 0) -> dict:
    """Build one small input, launch, synchronize. Never raises."""
    import torch
    run = spec.run
    rng = random.Random(seed)
    shape = run.draw_shape(rng, False)
    label = f"{run.describe(shape)} {run.dtypes[0]}"
    try:
        inputs = run.build(shape, run.dtypes[0], "cuda", torch.Generator().manual_seed(seed))
        run.run(inputs)
        torch.cuda.synchronize()
    except Exception as e:
        return {"ok": False, "shape": label,
                "error": f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return {"ok": True, "shape": label}
