"""Build a module's Triton kernels as the kind a launch needs, whatever the process.

Triton 3.6 reads TRITON_INTERPRET inside ``@triton.jit``, i.e. at import time, for the
kernel module and for Triton's own standard library (``tl.max``, ``tl.zeros``, ...). So
the kernels that use this avoid the standard library's jit helpers (``tl.reduce`` with
their own two combine functions, ``_max_combine`` / ``_sum_combine``, instead of
``tl.max`` / ``tl.sum``; no ``tl.full``) and are rebuilt here from their raw functions, in
a copy of the module namespace, as interpreter or compiler functions. Then a test can set
the variable with monkeypatch at any time, and ``compile_spec`` works in an interpreting
process. The interpreter reduces with numpy only for Triton's own combine functions
(recognised by identity; anything else runs a Python call per element), so the
interpreter build gets those in place of the module's.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl


_BUILT: dict = {}  # (module, entry, interpret) -> the kernel, built once per process


def rebuild(module_globals: dict, names: tuple[str, ...], entry: str, interpret: bool):
    """The ``entry`` kernel of a module (``module_globals``) with every function in
    ``names`` (its @triton.jit functions, callees included) rebuilt as interpreter
    functions (``interpret``) or JIT functions; built on the first call, then the same
    object (so Triton's compile cache, kept on it, persists)."""
    key = (module_globals["__name__"], entry, bool(interpret))
    if key not in _BUILT:
        _BUILT[key] = _build(module_globals, names, entry, interpret)
    return _BUILT[key]


def _build(module_globals: dict, names: tuple[str, ...], entry: str, interpret: bool):
    from triton.runtime.interpreter import InterpretedFunction
    wrap = InterpretedFunction if interpret else triton.runtime.JITFunction
    ns = dict(module_globals)
    for name in names:
        raw = module_globals[name].fn
        fn = types.FunctionType(raw.__code__, ns, raw.__name__, raw.__defaults__,
                                raw.__closure__)
        # FunctionType copies no annotations: without them every tl.constexpr parameter
        # would compile as a run-time value (both branches of each switch built)
        fn.__annotations__ = dict(raw.__annotations__)
        fn.__kwdefaults__ = raw.__kwdefaults__
        ns[name] = wrap(fn)
    if interpret:
        ns["_max_combine"] = tl.standard._elementwise_max
        ns["_sum_combine"] = tl.standard._sum_combine
    return ns[entry]
