"""Kernel specs: what the ladder needs to know about a kernel, and how to load a user's.

A :class:`KernelSpec` names a kernel and gives, per compute capability, the four things a
compile needs (``compile_spec(cc) -> {"fn", "signature", "constexprs", "options"}``); a
:class:`RunSpec` adds what gates 3-7 need: a shape sampler, an input builder, the kernel
runner, a reference, and optionally a baseline to time against.

A user's kernel comes in three ways:

* ``module:function`` naming a :class:`KernelSpec`, a list of them, or a function of no
  arguments returning either;
* ``--spec FILE.py``: a Python file defining ``SPECS`` (a list) or ``specs()``;
* ``--spec FILE.toml`` (Python 3.11+), one table per kernel::

      [kernel.my_matmul]
      function = "mypkg.kernels:matmul"           # the @triton.jit function
      signature = { a_ptr = "*fp16", M = "i32" }  # Triton signature strings
      constexprs = { BLOCK_M = 128 }
      options = { num_warps = 4, num_stages = 3 }
      run = "mypkg.kernels:run_spec"              # optional: returns a RunSpec (gates 3-7)

Every way of failing to load gives a spec whose ``unavailable`` holds one line saying
what to fix, so one bad kernel never stops the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RunSpec:
    """What gates 3-7 need to run a kernel.

    draw_shape(rng, small) -> dict: one valid shape, small=True for the interpreter.
    build(shape, dtype, device, generator) -> inputs (any object the runner takes).
    run(inputs) -> tensor or tuple of tensors (outputs allocated NaN-poisoned).
    reference(inputs) -> same structure, float64.
    baseline(inputs) -> anything: what gate 7 times the kernel against.
    timed(inputs) -> anything: what gate 7 times of the kernel, when run does more than
        the kernel call (e.g. reads the cache back on the host to check what it wrote);
        None: run.
    sanitizer_builds(shape) -> [dict]: the compile_spec overrides of every build the
        sanitizer gate's run of ``shape`` launches (a warp-specialized kernel's dispatch
        bytes differ per build, and the racecheck waiver covers only builds it knows);
        None: the compiled build and one per other head dim ``D`` of the shapes.
    lse_outputs: the indices of run's outputs that are log-sum-exps, held to the tests'
        LSE rule (max |lse - ref| / max(1, |ref|) against LSE_TOL) instead of the
        norm-wide relative error.
    """
    draw_shape: Callable
    build: Callable
    run: Callable
    reference: Callable
    dtypes: tuple = ("bf16", "fp16")
    interpreter_dtypes: tuple = ("fp16",)  # the interpreter's bf16 tl.dot is wrong
    interpreter: bool = True               # can run under TRITON_INTERPRET=1 on CPU tensors
    baseline: Callable | None = None
    baseline_name: str | None = None
    profile_shapes: tuple = ()             # shapes the profile gate times (draw_shape if empty)
    sanitizer_shapes: tuple = ()           # small odd shapes for the sanitizer gate (drawn small if empty)
    describe: Callable = lambda shape: "-".join(f"{k}{v}" for k, v in shape.items())
    timed: Callable | None = None          # what the profile gate times (run if None)
    sanitizer_builds: Callable | None = None  # shape -> compile_spec overrides it launches
    lse_outputs: tuple = ()                # indices of outputs that are LSEs (gate 4's LSE rule)


@dataclass
class KernelSpec:
    name: str
    compile_spec: Callable | None = None  # cc -> {"fn", "signature", "constexprs", "options"}
    run: RunSpec | None = None
    unavailable: str | None = None        # why the kernel cannot be built at all
    origin: dict = field(default_factory=dict)  # how a child process finds this spec again
    description: str = ""


def _import_attr(ref: str) -> Any:
    """'pkg.mod:attr' (or 'path/to/file.py:attr') -> the attribute; raises with one line."""
    if ":" not in ref:
        raise ValueError(f"{ref!r} is not module:function")
    mod_name, attr = ref.rsplit(":", 1)
    if mod_name.endswith(".py"):
        mod = _load_file_module(mod_name)
    else:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:
            raise ValueError(f"cannot import module {mod_name!r}: {type(e).__name__}: {e}") from None
    if not hasattr(mod, attr):
        raise ValueError(f"module {mod_name!r} has no function {attr!r}")
    return getattr(mod, attr)


def _load_file_module(path: str):
    if not os.path.exists(path):
        raise ValueError(f"spec file {path!r} does not exist")
    name = "_wsattn_spec_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise ValueError(f"spec file {path!r} failed to load: {type(e).__name__}: {e}") from None
    return mod


def _as_specs(obj, ref: str) -> list:
    if callable(obj) and not isinstance(obj, KernelSpec) and not hasattr(obj, "arg_names"):
        obj = obj()
    if isinstance(obj, KernelSpec):
        obj = [obj]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(s, KernelSpec) for s in obj):
        return list(obj)
    if hasattr(obj, "arg_names"):
        raise ValueError(f"{ref} is a jit function: describe it in a spec (--spec FILE.toml or "
                         "a Python KernelSpec) with its signature and constexprs")
    raise ValueError(f"{ref} must be a KernelSpec, a list of them, or a function returning them")


def unavailable(name: str, reason: str, origin=None) -> KernelSpec:
    return KernelSpec(name=name, unavailable=reason, origin=origin or {})


def load_ref(ref: str) -> list:
    """Specs from 'module:function'; a spec marked unavailable if that fails."""
    origin = {"kind": "module", "ref": ref}
    try:
        specs = _as_specs(_import_attr(ref), ref)
    except Exception as e:
        return [unavailable(ref, str(e), origin)]
    for s in specs:
        s.origin = s.origin or origin
    return _unique(specs, ref, origin)


def _static_compile_spec(fn, signature, constexprs, options):
    def compile_spec(cc):
        return {"fn": fn, "signature": dict(signature), "constexprs": dict(constexprs),
                "options": dict(options)}
    return compile_spec


def _from_table(name: str, table: dict, path: str) -> KernelSpec:
    origin = {"kind": "file", "path": os.path.abspath(path), "name": name}
    fref = table.get("function")
    if not fref:
        return unavailable(name, f"{path}: [kernel.{name}] needs function = \"module:function\"", origin)
    try:
        fn = _import_attr(fref)
    except Exception as e:
        return unavailable(name, str(e), origin)
    run = None
    if table.get("run"):
        try:
            run = _import_attr(table["run"])
            run = run() if callable(run) and not isinstance(run, RunSpec) else run
            if not isinstance(run, RunSpec):
                raise ValueError(f"run = {table['run']!r} must give a RunSpec")
        except Exception as e:
            return unavailable(name, str(e), origin)
    return KernelSpec(name=name, compile_spec=_static_compile_spec(
        fn, table.get("signature", {}), table.get("constexprs", {}), table.get("options", {})),
        run=run, origin=origin, description=table.get("description", ""))


def load_file(path: str) -> list:
    """Specs from a .py or .toml file; one unavailable spec naming the problem if it fails."""
    origin = {"kind": "file", "path": os.path.abspath(path)}
    if path.endswith(".toml"):
        try:
            import tomllib
        except ImportError:
            return [unavailable(path, "TOML specs need Python 3.11+ (tomllib); write the spec "
                                      "in Python (SPECS = [KernelSpec(...)]) instead", origin)]
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            return [unavailable(path, f"spec file {path!r} does not exist", origin)]
        except Exception as e:
            return [unavailable(path, f"{path}: invalid TOML: {e}", origin)]
        kernels = data.get("kernel", {})
        if not kernels:
            return [unavailable(path, f"{path} has no [kernel.NAME] tables", origin)]
        return [_from_table(n, t, path) for n, t in kernels.items()]
    try:
        mod = _load_file_module(path)
        obj = getattr(mod, "SPECS", None) or getattr(mod, "specs", None)
        if obj is None:
            raise ValueError(f"spec file {path!r} defines neither SPECS nor specs()")
        specs = _as_specs(obj, path)
    except Exception as e:
        return [unavailable(path, str(e), origin)]
    for s in specs:
        s.origin = s.origin or {**origin, "name": s.name}
    return _unique(specs, path, origin)


def _unique(specs: list, where: str, origin: dict) -> list:
    """specs, or one unavailable spec naming a kernel name given twice (a child process
    finds a spec again by its name: the second would run the first's kernel)."""
    seen = set()
    for s in specs:
        if s.name in seen:
            return [unavailable(where, f"{where} defines kernel {s.name!r} twice; names must "
                                       "be unique within a spec file", origin)]
        seen.add(s.name)
    return specs


def resolve(origin: dict, name: str) -> KernelSpec:
    """Find a spec again from its origin (in a child process)."""
    kind = origin.get("kind")
    if kind == "library":
        from .library import get
        return get(origin["name"])
    if kind == "module":
        specs = load_ref(origin["ref"])
    elif kind == "file":
        specs = load_file(origin["path"])
    else:
        raise ValueError(f"cannot find kernel {name!r} again: unknown origin {origin}")
    for s in specs:
        if s.name == name:
            return s
    broken = [s.unavailable for s in specs if s.unavailable]
    raise ValueError(broken[0] if broken else f"kernel {name!r} not found in {origin}")
