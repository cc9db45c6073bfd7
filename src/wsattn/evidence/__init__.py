"""The evidence ladder: how far a kernel's claims are supported, gate by gate.

``wsattn ladder`` climbs, per (kernel, target): 0 target path, 1 compile (no GPU needed),
2 structure (warp specialization formed or not, and why), 3 launch, 4 numerics,
5 stress (hangs and races), 6 sanitizer (compute-sanitizer's memcheck, racecheck,
synccheck, initcheck), 7 profile against a baseline, stopping at the first gate a
kernel fails, and states no more than the highest gate reached. ``wsattn targets`` is the
card ledger: every library kernel against every target. See notes/evidence.md.
"""

from .ladder import GATES, Config, LadderResult, climb
from .spec import KernelSpec, RunSpec, load_file, load_ref

__all__ = ["GATES", "Config", "LadderResult", "climb", "KernelSpec", "RunSpec", "load_file", "load_ref"]
