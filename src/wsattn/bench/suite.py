"""Run cases x runners: check each output against the reference, then time the ones that
passed, a case's runners together in alternating rounds.

A row whose output fails the check is recorded as failed and never timed; an impl that
cannot run here is recorded as 'not available: <reason>'; any other exception becomes an
'error' row. Nothing an implementation does stops the run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .report import make_row
from .runners import NotAvailable, check_output, make_inputs
from .timing import _sync, release, time_interleaved


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]




@dataclass
class Pending:
    """A checked column waiting to be timed: its function, and the row it becomes once
    timed (``ok(timing, samples, stamps)``: time_interleaved's result) or when timing
    raises (``error(reason)``)."""
    fn: Callable
    ok: Callable
    error: Callable

    @classmethod
    def of(cls, fn, make_row, **row):
        """The usual column: ``make_row(status="ok", timing=, samples=, stamps=, **row)``
        once timed, ``make_row(status="error", reason=, **row)`` where timing raises."""
        return cls(fn, lambda timing, samples, stamps: make_row(
            status="ok", timing=timing, samples=samples, stamps=stamps, **row),
            lambda reason: make_row(status="error", reason=reason, **row))


def time_rows(slots: list, timer) -> list[dict]:
    """Rows in slot order: a slot is a finished row (not available, an error, a failed
    check), or a :class:`Pending` column; all pending columns are timed together in
    alternating rounds (``timing.time_interleaved``), so that a kernel and its peers are
    sampled over the same stretch of time and ratios can be paired by round
    (``report.paired_ratio``)."""
    pending = [s for s in slots if isinstance(s, Pending)]
    timed = iter(time_interleaved(timer, [p.fn for p in pending]))
    rows = []
    for s in slots:
        if not isinstance(s, Pending):
            rows.append(s)
            continue
        result = next(timed)
        if isinstance(result, BaseException):
            rows.append(s.error("while timing: " + _short(result)))
        else:
            rows.append(s.ok(*result))
    return rows


def check_one(case, runner, inputs, stamp, device):
    """Prepare one runner, call it once and check the output against the reference: the
    row where it cannot be timed (not available, an error, a failed check), else the
    :class:`Pending` column."""
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
    return Pending.of(prepared.fn, functools.partial(make_row, stamp, case, runner.name),
                      check=check, note=prepared.note)


def run_case(case, runners, inputs, timer, stamp, device, progress=None) -> list[dict]:
    """One case's rows: every runner checked first, then the ones that passed timed
    together (:func:`time_rows`)."""
    slots = []
    for runner in runners:
        if progress is not None:
            progress.set_postfix_str(f"{case.id} {runner.name}", refresh=True)
        slots.append(check_one(case, runner, inputs, stamp, device))
    rows = time_rows(slots, timer)
    if progress is not None:
        progress.update(len(runners))
    return rows


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
        rows += run_case(case, todo, inputs, timer, stamp, device, progress)
        del inputs
        release(device)
    return rows
