"""Work-arounds for the Triton release the project pins (3.6), in one place.

patch_interpreter_for_numpy_2_4: Triton 3.6's interpreter turns a scalar into an int
with int(array of shape [1]), which numpy >= 2.4 refuses (and 1.25-2.3 warn about, once
per loop step), so every loop with a run-time bound fails under TRITON_INTERPRET=1
(triton-lang/triton#9171, fixed upstream after 3.6.0 by taking the single element). The project's venv pins numpy < 2.4; this patch
keeps the interpreter usable where a newer numpy is installed (tests, the smoke run and
the evidence ladder's interpreter child call it). Process-wide and idempotent.

patch_interpreter_device_calls: Triton 3.6's interpreter patches the language for every
call of a jit *device* function (``InterpretedFunction.__call__``) and never restores it.
When the callee is in Triton's standard library (``tl.max``, ``tl.sum``, ``tl.cdiv``: their
module sees ``triton.language.core``, not the ``tl`` package the kernel's own scope
patched and restores), ``triton.language.core`` keeps interpreter lambdas for good, and any
later *compile* in the same process fails ("Unsupported function referenced:
_patch_attr.<locals>.<lambda>"). Found when the CPU suite ran the decode kernel (which uses
tl.max / tl.sum) through the interpreter before the ladder's compile tests on one worker.
The patch restores each device call's patches when the call returns, and skips patching
where every language module the callee sees is already patched by a caller (the kernel's
own scope, or an outer device call): re-patching the same modules with the same builder
changes nothing, and it was a third of the CPU suite's interpreter time (``inspect.getmembers``
over the language for every call of every helper).

patch_interpreter applies both; call it once before interpreting.
"""

from __future__ import annotations


def patch_interpreter_for_numpy_2_4() -> bool:
    """Apply the patch where numpy refuses or warns (>= 1.25); True when this call applied it."""
    import numpy as np
    from triton.runtime import interpreter

    if (np.lib.NumpyVersion(np.__version__) < "1.25.0"
            or getattr(interpreter, "_wsattn_patched", False)):
        return False
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._wsattn_patched = True
    return True


def patch_interpreter_device_calls() -> bool:
    """Make each interpreted device-function call undo its language patches on return."""
    import collections
    import inspect
    import types

    from triton.runtime import interpreter

    if getattr(interpreter.InterpretedFunction, "_wsattn_restores", False):
        return False
    tl = interpreter.tl
    patch_lang = interpreter._patch_lang
    active = collections.Counter()  # id(language module) -> scopes now patching it
    langs_of = {}  # function -> the language modules its globals see (_patch_lang's rule)

    def langs(fn):
        if fn not in langs_of:
            langs_of[fn] = tuple(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    # a function whose globals see only triton.language.core: patching "for" it patches
    # the module the standard library's helpers (tl.sum, tl.zeros, tl.cdiv, ...) see
    core_probe = types.FunctionType((lambda: None).__code__, {"core": tl.core})

    def tracked_patch_lang(fn):
        # every scope (the kernel's in GridExecutor, a device call's below) counts the
        # modules it patched until it is restored; a kernel's scope patches
        # triton.language.core too, so that its calls into the standard library find it
        # patched
        scope = patch_lang(fn)
        mods = langs(fn)
        core = None
        if not active[id(tl.core)] and id(tl.core) not in mods:
            core = patch_lang(core_probe)
            mods += (id(tl.core),)
        active.update(mods)
        restore = scope.restore

        def restore_and_count():
            if core is not None:
                core.restore()
            restore()
            active.subtract(mods)

        scope.restore = restore_and_count
        return scope

    def call(self, *args, **kwargs):
        fn = self.rewrite()
        covered = all(active[m] > 0 for m in langs(self.fn))
        scope = None if covered else interpreter._patch_lang(self.fn)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e
        finally:
            # undone in reverse order: attributes the calling kernel had already patched
            # go back to the kernel's versions, the rest to Triton's own
            if scope is not None:
                scope.restore()

    interpreter._patch_lang = tracked_patch_lang

    interpreter.InterpretedFunction.__call__ = call
    interpreter.InterpretedFunction._wsattn_restores = True
    return True


def patch_interpreter() -> None:
    """Both interpreter work-arounds above; process-wide and idempotent."""
    patch_interpreter_for_numpy_2_4()
    patch_interpreter_device_calls()
