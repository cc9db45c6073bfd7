"""The Triton 3.6 interpreter work-arounds (wsattn/_triton_compat.py): device calls inside an
interpreted kernel patch the language only where no caller has, every patch is undone when
the kernel returns (a later compile in the same process still works), and results are those
of the unpatched interpreter."""

from __future__ import annotations

import textwrap

from conftest import interpreter_child

CHILD = textwrap.dedent(r'''
    import json
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter
    from wsattn._triton_compat import patch_interpreter

    calls = []
    original = interpreter._patch_lang

    def counted(fn):
        calls.append(fn.__name__)
        return original(fn)

    interpreter._patch_lang = counted  # under the compat layer's own wrapper
    patch_interpreter()

    @triton.jit
    def inner(x):
        return x * 2.0

    @triton.jit
    def middle(x):
        return inner(x) + tl.sum(x, axis=0)  # a helper of ours and one of the standard library

    @triton.jit
    def kernel(x_ptr, y_ptr, N: tl.constexpr, STEPS: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        acc = tl.zeros([N], dtype=tl.float32)
        for _ in range(STEPS):
            acc += middle(x) + tl.cdiv(N, 4)
        tl.store(y_ptr + offs, acc)

    def snapshot():  # what the interpreter patches: public names and four tensor dunders
        dunders = ("__index__", "__bool__", "__repr__", "__str__")
        return {(mod.__name__, name): id(getattr(mod, name, None))
                for mod in (tl, tl.core, tl.math, tl.tensor)
                for name in [n for n in vars(mod) if not n.startswith("__")]
                + list(dunders if mod is tl.tensor else ())}

    before = snapshot()
    x = torch.arange(16, dtype=torch.float32)
    y = torch.empty(16)
    kernel[(2,)](x, y, N=16, STEPS=5)
    want = 5 * (2 * x + x.sum() + 4)
    print("RESULT " + json.dumps({
        "equal": bool(torch.equal(y, want)),
        "patches": calls,
        # every language attribute is Triton's own again once the launch returned
        "changed": sorted(str(k) for k, v in snapshot().items() if before.get(k) != v),
    }))
''')


def test_device_calls_patch_only_where_no_caller_has_and_everything_is_undone():
    r = interpreter_child(CHILD)
    assert r["equal"], r
    # one launch: the kernel's scope and the standard library's module, nothing a call
    # (10 device calls of ours and 10 of the standard library's in the loop)
    assert r["patches"] == ["kernel", "<lambda>"], r
    assert r["changed"] == [], r
