"""Work-arounds for the Triton release the project pins (3.6), in one place.

patch_interpreter_for_numpy_2_4: Triton 3.6's interpreter turns a scalar into an int
with int(array of shape [1]), which numpy >= 2.4 refuses (and 1.25-2.3 warn about, once
per loop step), so every loop with a run-time bound fails under TRITON_INTERPRET=1
(triton-lang/triton#9171, fixed upstream after 3.6.0 by taking the single element). The project's venv pins numpy < 2.4; this patch
keeps the interpreter usable where a newer numpy is installed (tests, the smoke run and
the evidence ladder's interpreter child call it). Process-wide and idempotent.
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
