"""Gate 5: stress under a watchdog, and the child-process runner the interpreter shares.

The kernel runs thousands of launches over varied shapes in a child process; each input
runs twice and the two outputs must be bit-identical (a moving result is a race). The
child writes the shape it is about to launch to a status file before each launch; if it
has not finished when the watchdog's time is up, it is killed and the gate reports a
hang at the last shape it announced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def run_child(task: str, args: dict, timeout: float, env: dict | None = None,
              progress=None, prefix: list | None = None) -> dict:
    """Run ``wsattn.evidence.child`` under a watchdog; returns its result (with the
    process's ``returncode``), or a hang. ``prefix`` wraps the child (a sanitizer: the
    command line becomes ``prefix + [python, -m, ...]``)."""
    fd, path = tempfile.mkstemp(prefix="wsattn-evidence-", suffix=".jsonl")
    os.close(fd)
    child_env = dict(os.environ)
    child_env.update(env or {})
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, child_env.get("PYTHONPATH")) if p)
    cmd = list(prefix or []) + [sys.executable, "-m", "wsattn.evidence.child", task,
                                json.dumps(args), path]
    t0 = time.monotonic()
    # stderr goes to a file, not a pipe: a child that warns on every launch would fill a
    # pipe's buffer, block, and look exactly like a hang.
    err_file = tempfile.TemporaryFile(mode="w+b")
    proc = subprocess.Popen(cmd, env=child_env, stdout=subprocess.DEVNULL, stderr=err_file,
                            start_new_session=True)
    try:
        hung = False
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                hung = True
                _kill(proc)
                break
            time.sleep(0.05)
            if progress:
                progress()
        err_file.seek(0)
        stderr = err_file.read()[-4000:].decode("utf-8", "replace")
        lines = [json.loads(l) for l in open(path) if l.strip()]
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): take our child down with us
            _kill(proc)
        err_file.close()
        os.remove(path)
    seconds = time.monotonic() - t0
    last_at = next((l["at"] for l in reversed(lines) if "at" in l), None)
    if hung:
        return {"ok": False, "kind": "hang", "shape": last_at, "seconds": seconds,
                "error": f"hang: no result after {timeout:.0f} s"
                         + (f", last launch at {last_at}" if last_at else "")}
    result = next((l["result"] for l in reversed(lines) if "result" in l), None)
    if result is None:
        tail = stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {"ok": False, "kind": "crash", "shape": last_at, "seconds": seconds,
                "error": f"child died (exit {proc.returncode})"
                         + (f" at {last_at}" if last_at else "") + f": {tail[0][:300]}",
                "returncode": proc.returncode}
    result["seconds"] = seconds
    result["returncode"] = proc.returncode
    return result


def _kill(proc):
    """Kill the child's own session (started for it by Popen), so a wrapper's target
    (the Python under compute-sanitizer) goes too, by that session's id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def run_stress(spec, device: str, launches: int = 2000, timeout: float = 300.0,
               distinct_shapes: int = 16, small: bool = False, seed: int = 0,
               check_every: int = 0) -> dict:
    """Gate 5 for ``spec`` on ``device`` ("cuda", or "cpu" for CPU runners and the
    interpreter)."""
    args = {"origin": spec.origin, "name": spec.name, "device": device, "launches": launches,
            "distinct_shapes": distinct_shapes, "small": small, "seed": seed,
            "check_every": check_every}
    env = {"TRITON_INTERPRET": "1"} if device == "cpu" else {"TRITON_INTERPRET": "0"}
    return run_child("stress", args, timeout, env)


def run_interpreter_numerics(spec, n_shapes: int, timeout: float = 600.0, seed: int = 0) -> dict:
    """Gate 4 through the Triton interpreter on CPU tensors, in a child process (Triton
    reads TRITON_INTERPRET when kernels are decorated, so it must be set before import)."""
    args = {"origin": spec.origin, "name": spec.name, "device": "cpu", "n_shapes": n_shapes,
            "small": True, "seed": seed}
    return run_child("numerics", args, timeout, {"TRITON_INTERPRET": "1", "WSATTN_POISON": "1"})
