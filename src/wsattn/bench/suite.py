"""Run cases x runners: check each output against the reference, then time it.

A row whose output fails the check is recorded as failed and never timed; an impl that
cannot run here is recorded as 'not available: <reason>'; any other exception becomes an
'error' row. Nothing an implementation does stops the run.
"""

from __future__ import annotations

from .report import make_row
from .runners import NotAvailable, check_output, make_inputs
from .timing import _sync, release


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]




def run_one(case, runner, inputs, timer, stamp, device) -> dict:
    """One row: prepare, call once, check against the reference, and only then time."""
    try:
        prepared = runner.prepare(case, inputs)
        out = prepared.first()
        _sync(device)
        check = check_output(inputs, prepared.canon(out))
    except NotAvailable as e:
        return make_row(stamp, case, runner.name, "not available", reason=str(e)[:300])
    except Exception as e:  # a broken impl must not stop the benchmark
        return make_row(stamp, case, runner.name, "error", reason=_short(e))
    del out
    if not check.passed:
        return make_row(stamp, case, runner.name, "failed", check=check, note=prepared.note,
                        reason=f"relative error {check.rel_err:.3e} > {check.tol:.1e}; not timed")
    try:
        timing = timer(prepared.fn)
    except Exception as e:
        return make_row(stamp, case, runner.name, "error", check=check, note=prepared.note,
                        reason="while timing: " + _short(e))
    return make_row(stamp, case, runner.name, "ok", check=check, timing=timing, note=prepared.note)


def run_cases(cases, runners, timer, stamp, device, progress=None) -> list[dict]:
    """Rows for every (case, runner) that applies, inputs built once per case."""
    rows = []
    for case in cases:
        todo = [r for r in runners if r.applies(case)]
        if not todo:
            continue
        try:
            inputs = make_inputs(case, device)
        except Exception as e:  # e.g. out of memory on a smaller GPU
            rows += [make_row(stamp, case, r.name, "error", reason="inputs: " + _short(e))
                     for r in todo]
            if progress is not None:
                progress.update(len(todo))
            continue
        for runner in todo:
            if progress is not None:
                progress.set_postfix_str(f"{case.id} {runner.name}", refresh=True)
            rows.append(run_one(case, runner, inputs, timer, stamp, device))
            if progress is not None:
                progress.update(1)
        del inputs
        release(device)
    return rows
