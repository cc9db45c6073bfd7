"""The stamp every benchmark row carries: what ran, where, built from which commit.

Host names are left out on purpose: results are committed to the repository.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[3]
NONE = "none"  # what GPU fields say on a machine without a GPU


def _run(cmd, cwd=None) -> str | None:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 and res.stdout.strip() else None


def git_commit(root: Path = REPO_ROOT) -> str:
    """Short commit of the tree, '-dirty' when tracked files differ from it.

    WSATTN_COMMIT overrides it, for copies of the tree made without .git."""
    if os.environ.get("WSATTN_COMMIT"):
        return os.environ["WSATTN_COMMIT"]
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root)
    if commit is None:
        return "unknown"
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit + ("-dirty" if dirty else "")


def driver_version() -> str:
    """The NVIDIA driver version (nvidia-smi), else the CUDA driver API version."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out:
        return out.splitlines()[0].strip()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"cuda-driver-api {v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return "unknown"


def stamp(device=None) -> dict:
    """Fields identifying the run. GPU fields say 'none' where there is no CUDA GPU."""
    import triton  # imported here so that importing wsattn.bench does not import triton

    now = datetime.datetime.now(datetime.timezone.utc)
    s = {
        "gpu": NONE, "cc": NONE, "num_sms": NONE, "driver": NONE,
        "cuda": torch.version.cuda or NONE,
        "torch": torch.__version__, "triton": triton.__version__,
        "cudnn": NONE, "python": platform.python_version(),
        "commit": git_commit(), "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if torch.cuda.is_available():
        device = torch.device("cuda") if device is None else torch.device(device)
        props = torch.cuda.get_device_properties(device)
        major, minor = torch.cuda.get_device_capability(device)
        s.update(gpu=props.name, cc=f"sm_{major}{minor}", num_sms=props.multi_processor_count,
                 driver=driver_version())
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        s["cudnn"] = str(cudnn) if cudnn else NONE
    return s


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200', for file names."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "unknown"


def json_name(s: dict) -> str:
    """The conventional name of a run's rows: bench_<gpu>_<date>_<commit>.json"""
    date = s["date"].replace("-", "").replace(":", "")[:13]  # 20261129T1405
    return f"bench_{slug(s['gpu'])}_{date}_{slug(s['commit'])}.json"
