"""Gate 2: the structure of a compiled kernel, read from its TTGIR, PTX and SASS.

What is read, and from where (Triton 3.6 text, checked against real compiles):

* warp specialization requested: ``tt.warp_specialize`` on a loop in the TTIR (from
  ``tl.range(..., warp_specialize=True)``), or ``gl.warp_specialize`` in a Gluon kernel;
* formed: a ``ttg.warp_specialize(...) attributes {requestedRegisters = array<i32: ...>}``
  op in the TTGIR, with a ``default { ... }`` region and ``partitionN(...) num_warps(K)``
  regions; each region's role is inferred from the ops inside it;
* ``setmaxnreg.{inc,dec}.sync.aligned.u32 N`` and ``mbarrier.init`` in the PTX;
* an opcode census of the SASS; registers per thread from the cubin; shared memory per
  CTA from the kernel metadata.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field

_OP_RE = re.compile(r"\b((?:tt|ttg|ttng|nvws|scf|math|amdgpu)\.[a-z_0-9]+)")
_PART_RE = re.compile(r"^\s*partition(\d+)\(.*\bnum_warps\((\d+)\)\s*\{\s*$")
_DEFAULT_RE = re.compile(r"^\s*default\s*\{\s*$")
_WS_OP_RE = re.compile(r"\bttg\.warp_specialize\(")
_REQ_RE = re.compile(r"requestedRegisters\s*=\s*array<i32(?::\s*([0-9,\s]*))?>")
_SETMAXNREG_RE = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")
_MODULE_WARPS_RE = re.compile(r'"ttg\.num-warps"\s*=\s*(\d+)')

# SASS opcodes (prefix match) the census reports.
SASS_GROUPS = {
    "HGMMA": ("HGMMA",),            # Hopper warpgroup MMA (wgmma)
    "UTCMMA": ("UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA"),  # Blackwell tcgen05
    "HMMA": ("HMMA",),              # mma.sync
    "UTMALDG": ("UTMALDG",),        # TMA load
    "UTMASTG": ("UTMASTG",),        # TMA store
    "SYNCS": ("SYNCS",),            # mbarrier traffic
    "USETMAXREG": ("USETMAXREG",),  # register reallocation between warp groups
    "LDL": ("LDL",),                # local-memory loads: register spills (or stack arrays)
    "STL": ("STL",),
}

MMA_OPS = ("ttng.warp_group_dot", "ttng.tc_gen5_mma", "ttng.tc_gen5_mma_scaled", "tt.dot",
           "tt.dot_scaled", "ttg.mma_v2", "ttng.mma")
TMA_LOAD_OPS = ("ttng.async_tma_copy_global_to_local", "ttng.async_tma_gather",
                "tt.descriptor_load", "tt.descriptor_gather")
STORE_OPS = ("ttng.async_tma_copy_local_to_global", "tt.descriptor_store", "tt.store",
             "ttng.async_tma_scatter", "tt.descriptor_scatter")
SOFTMAX_OPS = ("math.exp2", "math.exp")


@dataclass
class Partition:
    name: str          # "default", "partition0", ...
    warps: int
    registers: int | None
    role: str
    ops: dict = field(default_factory=dict)  # a few counted ops that decided the role


@dataclass
class Structure:
    ws_requested: bool
    ws_formed: bool
    ws_pass: str
    decline_reason: str | None = None
    partitions: list = field(default_factory=list)
    requested_registers: list = field(default_factory=list)
    setmaxnreg: list = field(default_factory=list)  # ["inc 232", "dec 40", ...] as found
    mbarriers: int = 0
    mma: str = "none"
    tma: bool = False
    sass: dict = field(default_factory=dict)
    regs_per_thread: int | None = None
    regs_per_cta: int | None = None
    shared_bytes: int | None = None
    num_warps_total: int | None = None
    spills: bool | None = None       # local memory in use: LDL/STL in SASS or a stack frame
    local_bytes: int | None = None   # stack + local bytes per thread (cuobjdump -res-usage)
    sass_error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- PTX

def mma_family(ptx: str) -> str:
    """The MMA instruction family the PTX uses: tcgen05, wgmma, mma.sync or none."""
    if re.search(r"\btcgen05\.mma\b", ptx):
        return "tcgen05"
    if re.search(r"\bwgmma\.mma_async\b", ptx):
        return "wgmma"
    if re.search(r"\bmma\.sync\b", ptx):
        return "mma.sync"
    return "none"


def uses_tma(ptx: str) -> bool:
    return bool(re.search(r"\bcp\.async\.bulk\.tensor\b", ptx))


def setmaxnreg_values(ptx: str) -> list:
    return [f"{kind} {n}" for kind, n in _SETMAXNREG_RE.findall(ptx)]


def mbarrier_count(ptx: str) -> int:
    return len(re.findall(r"\bmbarrier\.init\b", ptx))


# --------------------------------------------------------------------------- SASS

def sass_census(sass: str) -> dict:
    """Counts of the SASS opcodes that tell the story (see SASS_GROUPS)."""
    ops = Counter()
    for line in sass.splitlines():
        parts = line.split("\t")
        if len(parts) < 2:  # Triton's listing: "<control>\t<instruction>;"
            continue
        toks = parts[1].split()
        if not toks:
            continue
        op = toks[1] if toks[0].startswith("@") and len(toks) > 1 else toks[0]
        ops[op.rstrip(";").split(".")[0]] += 1
    return {g: sum(ops[p] for p in prefixes) for g, prefixes in SASS_GROUPS.items()}


# --------------------------------------------------------------------------- TTGIR

def _regions(lines, start):
    """From the ``ttg.warp_specialize(`` line at ``start``, the (name, warps, body lines)
    of its default and partition regions, found by brace depth."""
    regions, depth, current, cur_depth = [], 0, None, 0
    for line in lines[start + 1:]:
        if current is None:
            m = _PART_RE.match(line)
            if _DEFAULT_RE.match(line):
                current, cur_depth = ["default", None, []], depth
            elif m:
                current, cur_depth = [f"partition{m.group(1)}", int(m.group(2)), []], depth
            elif depth == 0 and re.match(r"^\s*\}\s*:", line):
                break
        else:
            current[2].append(line)
        depth += line.count("{") - line.count("}")
        if current is not None and depth == cur_depth:
            current[2].pop()  # the closing brace
            regions.append(tuple(current))
            current = None
        if depth < 0:
            break
    return regions


def _role(ops: Counter) -> tuple[str, dict]:
    has = lambda names: sum(ops[n] for n in names)
    mma, load, store, soft = has(MMA_OPS), has(TMA_LOAD_OPS), has(STORE_OPS), has(SOFTMAX_OPS)
    roles = []
    if load and not mma:
        roles.append("TMA producer")
    if mma:
        roles.append("MMA")
    if soft:
        roles.append("softmax/correction")
    if store:
        roles.append("epilogue store")
    if not roles:
        roles.append("other" if sum(ops.values()) > 2 else "idle (code outside the region)")
    return " + ".join(roles), {"mma": mma, "tma_load": load, "store": store, "exp": soft}


def parse_partitions(ttgir: str) -> tuple[list, list]:
    """The partitions of every ``ttg.warp_specialize`` op, and the requested registers."""
    lines = ttgir.splitlines()
    m = _MODULE_WARPS_RE.search(ttgir)
    module_warps = int(m.group(1)) if m else None
    partitions, requested = [], []
    for i, line in enumerate(lines):
        if not _WS_OP_RE.search(line):
            continue
        r = _REQ_RE.search(line)
        regs = [int(x) for x in r.group(1).replace(" ", "").split(",") if x] if r and r.group(1) else []
        requested.extend(regs)
        workers = 0
        for name, warps, body in _regions(lines, i):
            ops = Counter(_OP_RE.findall("\n".join(body)))
            role, why = _role(ops)
            reg = None
            if name != "default":
                reg = regs[workers] if workers < len(regs) else None
                workers += 1
            partitions.append(Partition(name, warps if warps is not None else module_warps,
                                        reg, role, why))
    return partitions, requested


# --------------------------------------------------------------------------- requested / why declined

def _ws_loops(ttir: str) -> list:
    """Bodies of the loops carrying ``tt.warp_specialize`` in the TTIR."""
    lines, stack, bodies = ttir.splitlines(), [], []
    for idx, line in enumerate(lines):
        for pos, ch in enumerate(line):
            if ch == "{":
                stack.append(idx)
            elif ch == "}" and stack:
                start = stack.pop()
                if "tt.warp_specialize" in line[pos:]:
                    bodies.append("\n".join(lines[start + 1:idx]))
    return bodies


def _source_tree(fn):
    try:
        return ast.parse(textwrap.dedent(fn.src))
    except Exception:
        return None


def requested_in_source(fn, constexprs) -> bool:
    """``warp_specialize=<truthy>`` in the kernel source, or a ``warp_specialize(`` call
    (Gluon); used when the TTIR is not available (the compile failed early)."""
    tree = _source_tree(fn)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if getattr(f, "attr", getattr(f, "id", None)) == "warp_specialize":
                return True
            for kw in node.keywords:
                if kw.arg == "warp_specialize":
                    v = kw.value
                    if isinstance(v, ast.Constant):
                        return bool(v.value)
                    if isinstance(v, ast.Name):
                        return bool((constexprs or {}).get(v.id, True))
                    return True
    return False


def _has_else(fn) -> bool:
    tree = _source_tree(fn)
    return tree is not None and any(isinstance(n, ast.If) and n.orelse for n in ast.walk(tree))


def host_desc_block_m(signature: dict) -> int | None:
    """The largest leading block dimension of a host tensor-descriptor argument."""
    dims = [int(m.group(1)) for v in (signature or {}).values()
            for m in [re.match(r"tensordesc<\w+\[(\d+)", str(v))] if m]
    return max(dims) if dims else None


def known_decline_reasons(cc, fn, signature, options, ttir: str | None) -> list:
    """The reasons shared/FACTS.md lists for the sm_90 pass declining, found in this kernel.
    Empty for cc >= 100 (the automatic pass publishes no such list)."""
    if not 80 <= cc < 100:
        return []
    reasons = []
    if cc < 90:
        reasons.append(f"sm_{cc} has no TMA: descriptor loads become pointer loads")
    nw = (options or {}).get("num_warps", 4)
    if nw != 4:
        reasons.append(f"num_warps={nw} (the sm_90 pass needs num_warps=4)")
    if _has_else(fn) or (ttir and "} else {" in ttir):
        reasons.append("an else block in the function")
    if ttir:
        loops = _ws_loops(ttir)
        if loops and not any(re.search(r"\btt\.dot(_scaled)?\b", b) for b in loops):
            reasons.append("no dot in the warp-specialized loop")
        if len(loops) > 1:
            reasons.append(f"{len(loops)} warp-specialized loops (the sm_90 pass takes one)")
        if cc >= 90 and any(re.search(r"\btt\.load\b", b) for b in loops):
            reasons.append("pointer loads in the loop (the sm_90 pass needs descriptor loads)")
    bm = host_desc_block_m(signature)
    if bm is not None and bm >= 128:
        reasons.append(f"host tensor descriptor with BLOCK_M={bm} >= 128")
    return reasons


# --------------------------------------------------------------------------- the gate

def analyse(compiled, fn, signature, options) -> Structure:
    """Structure of a successful :class:`CompileResult`."""
    from .compile_gate import expected_path, resource_usage
    cc = compiled.cc
    ttir = compiled.stages.get("ttir", "")
    ttgir = compiled.stages.get("ttgir", "")
    ptx = compiled.stages.get("ptx", "")
    language = compiled.language
    if language == "gluon":
        requested = requested_in_source(fn, {})
    else:
        requested = "tt.warp_specialize" in ttir
    partitions, regs = parse_partitions(ttgir)
    formed = bool(partitions)
    st = Structure(ws_requested=requested or formed, ws_formed=formed,
                   ws_pass=("explicit (gl.warp_specialize)" if language == "gluon"
                            else expected_path(cc)["ws_pass"]),
                   partitions=partitions, requested_registers=regs,
                   setmaxnreg=setmaxnreg_values(ptx), mbarriers=mbarrier_count(ptx),
                   mma=mma_family(ptx), tma=uses_tma(ptx))
    if st.ws_requested and not formed:
        reasons = known_decline_reasons(cc, fn, signature, options, ttir)
        # Several causes can be present; which one tripped the pass is not written anywhere.
        st.decline_reason = (("known cause present: " if len(reasons) == 1 else "known causes present: ")
                             + "; ".join(reasons)) if reasons else "declined, reason unknown"
    md = compiled.metadata
    st.shared_bytes = md.get("shared")
    st.num_warps_total = md.get("num_warps")
    res = resource_usage(compiled.stages["cubin"]) if "cubin" in compiled.stages else None
    if res:
        st.regs_per_thread = res["regs_per_thread"]
        st.local_bytes = res["stack_bytes"] + res["local_bytes"]
        st.spills = st.local_bytes > 0
        if st.num_warps_total:
            st.regs_per_cta = res["regs_per_thread"] * 32 * st.num_warps_total
    sass = compiled.sass
    if sass:
        st.sass = sass_census(sass)
        st.spills = bool(st.spills or st.sass["LDL"] or st.sass["STL"])
    else:
        st.sass_error = compiled.metadata.get("sass_error")
    return st


def summary(st: Structure) -> str:
    """One line: formed with its partitions, or why not."""
    if st.ws_formed:
        parts = ", ".join(f"{p.name}: {p.warps}w {p.role}" + (f" {p.registers}r" if p.registers else "")
                          for p in st.partitions)
        return f"warp-specialized ({len(st.partitions)} partitions: {parts})"
    if st.ws_requested:
        return f"WARP SPECIALIZATION REQUESTED BUT NOT FORMED: {st.decline_reason}"
    return "not warp-specialized (not requested)"
