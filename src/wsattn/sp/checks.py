"""Cross-rank validation: the same clear error on every rank, never a hang.

A shape that is wrong on one rank only would, checked locally, raise on that rank and
leave its peers blocked in the next collective. So every sp entry point first runs
:func:`agree`: each rank packs the numbers that must match across ranks, plus the text
of any error it found locally, into one small fixed-size int64 tensor; one all-gather
of those tensors (with a host timeout) gives every rank the same picture, and every
rank raises the same error before the main collective starts.

The local checks must therefore refuse, before the agreement, everything that would
raise later on this rank: each entry point runs the single-GPU API's ``check_*`` twin of
the call it will make (``api.check_attention``, ``check_attention_varlen``,
``check_decode``) on this rank's shard, plus the sp rules, inside :func:`local_error`.

The exchange reads its result on the host, so it is skipped (``check=False`` on the
entry points) when the forward is captured in a CUDA graph.
"""

from __future__ import annotations

import math
import numbers
import os
import struct
import time
import zlib

import torch

from .comm import all_gather_flat, backend_of

N_FIELDS = 48
MSG_BYTES = 240
DEFAULT_TIMEOUT_S = float(os.environ.get("WSATTN_SP_TIMEOUT", "120"))


# dtypes as agreement fields (0: any other)
DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


class ShardError(ValueError):
    """Inputs that are inconsistent across ranks (or invalid on one of them)."""


def _meta_device(group) -> torch.device:
    # NCCL moves only CUDA tensors; gloo moves CPU tensors.
    if backend_of(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(op: str, fields: dict[str, int], error: str | None) -> torch.Tensor:
    if len(fields) > N_FIELDS - 3:
        raise AssertionError(f"{op}: too many metadata fields ({len(fields)})")
    vals = [zlib.crc32(op.encode()), len(fields), 1 if error else 0]
    vals += [int(v) for v in fields.values()]
    vals += [0] * (N_FIELDS - len(vals))
    msg = (error or "").encode("utf-8", "replace")[:MSG_BYTES]
    vals += list(msg) + [0] * (MSG_BYTES - len(msg))
    return torch.tensor(vals, dtype=torch.int64)


def _decode_msg(row: list[int]) -> str:
    raw = bytes(v for v in row[N_FIELDS:] if v)
    return raw.decode("utf-8", "replace")


def gather_meta(op: str, group, world_size: int, fields: dict[str, int],
                error: str | None = None, timeout_s: float | None = None) -> list[list[int]]:
    """All-gather every rank's packed metadata; raise TimeoutError (with a message
    saying what to look for) if a peer does not join within timeout_s."""
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    mine = _encode(op, fields, error).to(_meta_device(group))
    if world_size == 1:
        return [mine.tolist()]
    out, work = all_gather_flat(mine, world_size, group, async_op=True)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"wsattn.sp.{op}: the metadata exchange did not complete within {timeout_s:.0f} s; "
                f"a rank of the group (size {world_size}) never called {op} (or called another "
                "collective first). Every rank must call it with the same group; the process "
                "group is now unusable. Raise WSATTN_SP_TIMEOUT if ranks legitimately arrive late.")
        time.sleep(0.0005)
    work.wait()
    return out.tolist()


def agree(op: str, group, rank: int, world_size: int, fields: dict[str, int],
          error: str | None = None, same: tuple[str, ...] = (),
          timeout_s: float | None = None) -> list[dict[str, int]]:
    """Exchange fields and local errors; raise ShardError on every rank when any rank
    reported an error or when a field named in `same` differs across ranks.

    Returns each rank's fields (rank order) for checks that need them all. A timeout_s
    this rank cannot use is reported like any local error (the exchange then waits the
    default), so every rank raises it instead of one rank raising alone."""
    bad_timeout = timeout_error(timeout_s)
    if bad_timeout is not None:
        error, timeout_s = error or bad_timeout, None
    rows = gather_meta(op, group, world_size, fields, error, timeout_s)
    ops = {r[0] for r in rows}
    if len(ops) != 1 or len({r[1] for r in rows}) != 1:
        raise ShardError(f"wsattn.sp.{op}: the ranks of the group called different sp "
                         "operations at the same time; every rank must call the same one")
    bad = [(r, _decode_msg(row)) for r, row in enumerate(rows) if row[2]]
    if bad:
        first_rank, msg = bad[0]
        others = f" (and {len(bad) - 1} other rank(s))" if len(bad) > 1 else ""
        raise ShardError(f"wsattn.sp.{op}: rank {first_rank}{others}: {msg}")
    names = list(fields)
    per_rank = [dict(zip(names, row[3:3 + len(names)])) for row in rows]
    for name in same:
        vals = [f[name] for f in per_rank]
        if len(set(vals)) != 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
            raise ShardError(f"wsattn.sp.{op}: {name} must be the same on every rank of the "
                             f"group (size {world_size}), got {shown}")
    return per_rank


def local_error(fn) -> str | None:
    """Run a local check; its error text, or None when it passes.

    Any exception becomes text, not only ValueError/TypeError: whatever escaped here
    would leave this rank's peers blocked in the agreement until the timeout."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - reported on every rank by agree()
        return f"{type(e).__name__}: {e}"
    return None


def timeout_error(timeout_s) -> str | None:
    """Why timeout_s cannot bound a wait (None, or a positive finite number of seconds)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) \
            or not 0 < timeout_s < math.inf:
        return f"timeout_s must be None or a positive finite number of seconds, got {timeout_s!r}"
    return None


def scale_field(sm_scale) -> int:
    """sm_scale as an agreement field: its float64 bits (-1 for None, the default scale,
    which the agreed head dim fixes; -2 for what is not a number, which the local checks
    refuse)."""
    if sm_scale is None:
        return -1
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        return -2
    return struct.unpack("<q", struct.pack("<d", float(sm_scale)))[0]


def flag(name: str, value) -> None:
    """A Python bool: 0/1 or "False" would pass a truth test on one rank and be agreed on
    (int) differently, or not at all, on another."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} "
                        f"{value!r}")


def code(value, choices) -> int:
    """value's index in choices for the agreement fields, -1 when it is none of them."""
    return choices.index(value) if isinstance(value, str) and value in choices else -1


def check_device(name: str, t: torch.Tensor, group) -> None:
    """Tensors must live where the backend moves them: CUDA for NCCL (on the current
    device), CPU or CUDA for gloo."""
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; the shards must be on the CPU (gloo) or "
                         "a CUDA device")
    if backend_of(group) == "nccl":
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device} but the group's backend is NCCL, "
                             "which needs CUDA tensors")
        if t.device.index != torch.cuda.current_device():
            raise ValueError(f"{name} is on {t.device} but this rank's current CUDA device is "
                             f"cuda:{torch.cuda.current_device()}; call "
                             "torch.cuda.set_device(local_rank) and put the shards there")
