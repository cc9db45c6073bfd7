"""Gates 0 and 1: the target path a compile takes, and the compile itself, with no GPU.

The compile runs Triton's own stages one by one (source -> ttir -> ttgir -> llir -> ptx
-> cubin) for a ``GPUTarget`` named on the command line, with Triton's bundled ptxas.
Running the stages here rather than calling ``triton.compile`` keeps the IR of every
stage that succeeded when a later one fails, and names the stage that failed; MLIR
prints its diagnostics on file descriptor 2, so that is captured too. Nothing raises:
every failure comes back as a :class:`CompileResult` with ``ok=False``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from ..target import KNOWN_CCS

# Which MMA family and which warp-specialization pass a compute capability gets in
# Triton 3.6 (shared/FACTS.md): consumer Blackwell (12x) has TMA but no wgmma/tcgen05.
HOPPER_WS_PASS = "nvgpu-warp-specialization"
AUTO_WS_PASS = "tritongpu-automatic-warp-specialization"


def expected_path(cc: int) -> dict:
    """What Triton 3.6 is expected to do for a compute capability, before compiling."""
    if cc >= 120 or cc < 90:
        mma = "mma.sync"
    elif cc >= 100:
        mma = "tcgen05"
    else:
        mma = "wgmma"
    return {"mma_expected": mma, "tma_available": cc >= 90,
            "ws_pass": HOPPER_WS_PASS if cc < 100 else AUTO_WS_PASS}


def parse_target_name(name: str) -> int:
    """'sm_90' -> 90; raises ValueError with the known targets otherwise."""
    if name not in KNOWN_CCS:
        raise ValueError(f"unknown target {name!r}: expected one of {', '.join(KNOWN_CCS)}")
    return KNOWN_CCS[name]


@dataclass
class CompileResult:
    ok: bool
    cc: int
    stages: dict = field(default_factory=dict)  # stage name -> IR text (cubin: bytes)
    metadata: dict = field(default_factory=dict)
    failed_stage: str | None = None
    error: str | None = None
    seconds: float = 0.0
    language: str = "triton"
    _sass: str | None = None

    @property
    def sass(self) -> str | None:
        """SASS from the cubin through the bundled cuobjdump (computed once, None if it fails)."""
        if self._sass is None and "cubin" in self.stages:
            with _capture_fd2() as err:
                try:
                    self._sass = sass_listing(self.stages["cubin"])
                except Exception as e:  # e.g. the bundled nvdisasm cannot decode sm_103
                    self._sass = ""
                    self.metadata["sass_error"] = type(e).__name__
            if not self._sass:
                why = " ".join(err["text"].split())[:200] or self.metadata.get("sass_error", "")
                self.metadata["sass_error"] = f"no SASS from the bundled cuobjdump/nvdisasm: {why}"
        return self._sass or None


@contextlib.contextmanager
def _capture_fd2():
    """Collect what C++ code (MLIR diagnostics, ptxas) writes on file descriptor 2."""
    buf = {"text": ""}
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        try:
            saved = os.dup(2)
        except OSError:  # no fd 2 (embedded interpreters): collect nothing
            yield buf
            return
        os.dup2(tmp.fileno(), 2)
        try:
            yield buf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            buf["text"] = tmp.read().decode("utf-8", "replace")


def check_arguments(fn, signature: dict, constexprs: dict) -> tuple[dict, str | None]:
    """Match a signature and constexprs against the kernel's arguments.

    Returns (full signature with constexprs marked, None) or (signature, one line naming
    what to fix)."""
    names = list(getattr(fn, "arg_names", []))
    if not names:
        return signature, f"{getattr(fn, '__name__', fn)!r} is not a @triton.jit or @gluon.jit function"
    fname = fn.__name__
    if type(fn).__name__ == "InterpretedFunction":
        return signature, (f"kernel {fname} was decorated under TRITON_INTERPRET=1 and cannot be "
                           "compiled: run the compile gates in a process without it")
    unknown = [k for k in list(signature) + list(constexprs) if k not in names]
    if unknown:
        return signature, (f"kernel {fname} has no argument {unknown[0]!r}; its arguments are "
                           f"{', '.join(names)}")
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in signature:
            if signature[n] == "constexpr":
                return signature, f"signature marks {n!r} constexpr but constexprs gives it no value"
            sig[n] = signature[n]
        else:
            params = getattr(fn, "params", [])
            p = next((p for p in params if p.name == n), None)
            if p is not None and getattr(p, "is_constexpr", False):
                if p.default is not inspect.Parameter.empty:
                    sig[n] = "constexpr"
                    constexprs[n] = p.default
                    continue
                return signature, f"constexpr {n!r} of kernel {fname} has no value: add it to constexprs"
            return signature, f"argument {n!r} of kernel {fname} is missing from the signature"
    return sig, None


def _one_line(e: Exception) -> str:
    """A compile error in one line; for a CompilationError, its position and its message
    without the echoed source."""
    lines = [l for l in str(e).splitlines() if l.strip()]
    if type(e).__name__ == "CompilationError" and lines:
        caret = max((i for i, l in enumerate(lines) if set(l.strip()) == {"^"}), default=None)
        msg = " ".join(lines[caret + 1:]) if caret is not None else " ".join(lines[1:])
        return f"{type(e).__name__} {lines[0].rstrip(':')}: {msg}".strip()
    return " ".join(f"{type(e).__name__}: {' '.join(lines)}".split())


def _first_error_line(text: str) -> str:
    """MLIR's first ``error:`` diagnostic, else a failed LLVM/MLIR assertion's message."""
    for line in text.splitlines():
        if "error:" in line and "Failures have been detected" not in line:  # that one says nothing
            return line.split("error:", 1)[1].strip()
    for line in text.splitlines():
        m = re.search(r"Assertion `(.*)' failed", line)
        if m:
            return f"compiler assertion failed: {m.group(1)}"
    return ""


def compile_kernel(fn, signature: dict, constexprs: dict, options: dict, cc: int,
                   attrs: dict | None = None) -> CompileResult:
    """Compile ``fn`` for ``cuda:cc`` stage by stage; never raises."""
    t0 = time.perf_counter()
    constexprs = dict(constexprs or {})
    sig, problem = check_arguments(fn, dict(signature or {}), constexprs)
    language = "gluon" if getattr(fn, "is_gluon", lambda: False)() else "triton"
    res = CompileResult(ok=False, cc=cc, language=language)
    if problem:
        res.failed_stage, res.error = "arguments", problem
        return res
    try:
        import triton
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend

        target = GPUTarget("cuda", cc, 32)
        if language == "gluon":
            from triton.experimental.gluon._runtime import GluonASTSource as Source
        else:
            Source = ASTSource
        src = Source(fn, signature=sig, constexprs=constexprs, attrs=attrs)
        backend = make_backend(target)
        opts = backend.parse_options(dict(options or {}, **src.parse_options()))
        metadata = {"target": target, **opts.__dict__, "triton_version": triton.__version__,
                    "hash": "evidence"}
        stages: dict = {}
        backend.add_stages(stages, opts, src.language)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        codegen_fns = backend.get_codegen_implementation(opts)
        module_map = backend.get_module_map()
    except Exception as e:
        res.failed_stage, res.error = "setup", f"{type(e).__name__}: {e}".splitlines()[0]
        return res
    stage = "source"
    with _capture_fd2() as err:
        try:
            module = src.make_ir(target, opts, codegen_fns, module_map, context)
            res.stages["source"] = str(module)
            for stage, step in stages.items():
                module = step(module, metadata)
                res.stages[stage] = module if isinstance(module, (bytes, str)) else str(module)
            res.ok = True
        except Exception as e:
            res.failed_stage = stage
            res.error = _one_line(e)
    if not res.ok:
        diag = _first_error_line(err["text"])
        if diag and diag not in res.error:
            res.error = f"{diag} ({res.error[:200]})"
        res.error = res.error[:400]
    res.metadata = {k: v for k, v in metadata.items() if k != "target"}
    res.seconds = time.perf_counter() - t0
    return res


# One instruction of `cuobjdump -sass`: "/*0c40*/  @!P1 FMUL R24, R24, 16777216 ;  /* 0x... */"
_SASS_LINE_RE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;\s*(?:/\*\s*0x[0-9a-f]+\s*\*/)?\s*$")
_SASS_FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)")


def sass_listing(cubin: bytes) -> str:
    """Every function's SASS from ``cuobjdump -sass``, one "-\t<instruction>;" line per
    instruction under a "Function:<name>" line (the layout sass_census and the tests read).

    Written here because Triton 3.6's triton.tools.disasm.get_sass stops at the first line
    its pattern does not match and returns what it has so far: for the Gluon prefill kernel
    it returned ~4,000 of ~6,900 instructions, without the producer's TMA loads."""
    from triton import knobs
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                             timeout=120, check=True).stdout
    lines = []
    for line in out.splitlines():
        if m := _SASS_LINE_RE.match(line):
            lines.append(f"-\t{m.group(1)};")
        elif m := _SASS_FUNC_RE.match(line):
            lines.append(f"Function:{m.group(1)}")
    return "\n".join(lines) + "\n"


_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict | None:
    """Registers per thread, stack, static shared and local bytes from the cubin
    (``cuobjdump -res-usage``: the driver's n_regs, read without a driver)."""
    try:
        from triton import knobs
        tool = knobs.nvidia.cuobjdump.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                                 timeout=60).stdout
    except Exception:
        return None
    m = _RES_RE.search(out)
    if not m:
        return None
    reg, stack, shared, local = (int(x) for x in m.groups())
    return {"regs_per_thread": reg, "stack_bytes": stack, "static_shared_bytes": shared,
            "local_bytes": local}
