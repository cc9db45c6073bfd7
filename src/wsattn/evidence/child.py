"""Child-process side of the numerics (interpreter), stress and sanitizer gates.

``python -m wsattn.evidence.child TASK ARGS_JSON STATUS_PATH``: finds the spec again from
its origin, runs the task, and writes JSON lines to STATUS_PATH: ``{"at": shape}`` before
each launch (so a parent that kills a hung child knows the shape), ``{"result": ...}`` at
the end. The parent sets TRITON_INTERPRET in this process's environment before Triton is
imported: Triton decides interpreter or compiler when a kernel is decorated, at import.
"""

from __future__ import annotations

import json
import random
import sys


def _bits(t):
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _stress(spec, args, status):
    import torch
    from .numerics import copy_inputs, within
    run = spec.run
    rng = random.Random(args.get("seed", 0))
    gen = torch.Generator().manual_seed(args.get("seed", 0))
    device, launches, small = args["device"], args["launches"], args.get("small", False)
    if launches < 2:
        return {"ok": False, "kind": "not_run", "launches": 0, "distinct_shapes": 0,
                "error": f"stress needs at least 2 launches (one input run twice), got "
                         f"{launches}"}
    dtypes = run.interpreter_dtypes if device == "cpu" else run.dtypes
    pool = [run.draw_shape(rng, small) for _ in range(args.get("distinct_shapes", 16))]
    done, built, ran = 0, {}, set()
    while done < launches:
        pair = done // 2  # every (shape, dtype) pair in turn, not shape i with dtype i % 2
        i = pair % len(pool)
        shape, dtype = pool[i], dtypes[pair // len(pool) % len(dtypes)]
        label = f"{run.describe(shape)} {dtype}"
        status(at=label)
        if (i, dtype) not in built:  # inputs built once per (shape, dtype): launches dominate
            built[(i, dtype)] = run.build(shape, dtype, device, gen)
        inputs = built[(i, dtype)]
        ran.add(i)
        # copied: a runner that returns a buffer it was given (and writes it again on the
        # second run) is compared with what the first run wrote, not with itself
        first = copy_inputs(run.run(inputs))
        second = run.run(inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        done += 2
        for a, b in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (first, second))):
            if not torch.equal(_bits(a), _bits(b)):
                diff = (a.double() - b.double()).abs()
                return {"ok": False, "kind": "race", "launches": done, "shape": label,
                        "error": f"race: two runs of the same input differ at {label} "
                                 f"(max |diff| {diff.nan_to_num(0).max().item():.3e})"}
        if args.get("check_every") and done // 2 % args["check_every"] == 0:
            ok, why, _ = within(first, run.reference(inputs), dtype, run.lse_outputs)
            if not ok:
                return {"ok": False, "kind": "wrong", "launches": done, "shape": label,
                        "error": f"wrong result under stress at {label}: {why}"}
    return {"ok": True, "launches": done, "distinct_shapes": len(ran)}


def _sanitize(spec, args, status):
    """Each shape once, synchronized, under the sanitizer that wraps this process: the
    tool reports on the launches; the result only says which ran."""
    import torch
    run = spec.run
    gen = torch.Generator().manual_seed(args.get("seed", 0))
    dtype, launched = args["dtype"], []
    if args.get("zero_scratch") and args["device"] == "cuda":
        import triton  # see sanitizer.ZERO_SCRATCH_NOTE
        triton.set_allocator(lambda size, alignment, stream:
                             torch.zeros(size, dtype=torch.int8, device="cuda"))
    for shape in args["shapes"]:
        label = f"{run.describe(shape)} {dtype}"
        status(at=label)
        inputs = run.build(shape, dtype, args["device"], gen)
        run.run(inputs)
        if args["device"] == "cuda":
            torch.cuda.synchronize()
        launched.append(label)
    return {"ok": True, "launched": launched}


def main(argv):
    task, args, path = argv[0], json.loads(argv[1]), argv[2]
    out = open(path, "a", buffering=1)

    def status(**kv):
        out.write(json.dumps(kv) + "\n")
        out.flush()

    try:
        import os
        if os.environ.get("TRITON_INTERPRET") == "1":
            from .._triton_compat import patch_interpreter
            patch_interpreter()
        from .spec import resolve
        spec = resolve(args["origin"], args["name"])
        if spec.run is None:
            raise ValueError(f"kernel {args['name']} has no RunSpec")
        if task == "numerics":
            from .numerics import run_numerics
            result = run_numerics(spec, args["device"], args["n_shapes"], args.get("small", True),
                                  args.get("seed", 0))
        elif task == "stress":
            result = _stress(spec, args, status)
        elif task == "sanitize":
            result = _sanitize(spec, args, status)
        else:
            raise ValueError(f"unknown task {task!r}")
    except Exception as e:
        result = {"ok": False, "kind": "error",
                  "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    status(result=result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
