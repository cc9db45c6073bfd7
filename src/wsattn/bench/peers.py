"""Peers in the benchmark: FlashAttention-4's Hopper kernels and FlashInfer, as runners.

Both are optional and imported only inside ``prepare``: ``import wsattn.bench`` never needs
them, and where one does not import, each of its rows is 'not available' with the import
error as the reason. They run in the same process, on the same inputs, through the same
check-then-time path (``suite.run_case``) as wsattn's own kernels.

* ``fa4``: the ahead-of-time FA4 wheel ``peer_fa4_aot`` (``shared/peers/README.md``). Its
  manifest says which kernels, which dtype and which GPU target it carries; a case outside
  them is 'not available' naming the missing kernel. Prefill: the dense MHA kernels
  ``prefill_d{D}_{full,causal}``; a GQA case gets K/V repeated to the query heads (noted in
  the row). Decode: the paged kernel ``decode_paged_d{D}_gqa{Hq/Hkv}_p{page}``; a contiguous
  cache [B, L, Hkv, D] is the same memory as 16-token pages in order, so it runs through an
  identity page table (noted in the row).
* ``flashinfer-fa3`` / ``flashinfer-fa2``: prefill through
  ``BatchPrefillWithRaggedKVCacheWrapper`` with that backend, the equal-length batch
  written as ragged (indptr 0, N, 2N, ...), GQA native.
* ``flashinfer`` (tensor cores) / ``flashinfer-cudacores``: decode through
  ``BatchDecodeWithPagedKVCacheWrapper``; a contiguous cache as 16-token pages, as for FA4.

FlashInfer runs with JIT compilation off (``FLASHINFER_DISABLE_JIT=1`` unless set): a
module the wheel does not carry (another dtype or head dim) raises MissingJITCacheError,
recorded as 'not available', instead of minutes of nvcc inside the benchmark.
"""

from __future__ import annotations

import importlib
import os

import torch

from .cases import DTYPES
from .runners import NotAvailable, Prepared, Runner

FA4_MODULE = "peer_fa4_aot"
FLASHINFER_MODULE = "flashinfer"
CONTIGUOUS_PAGE = 16  # a contiguous cache is read as pages of this many tokens, in order
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:240] if lines else ""


def _peer_environment():
    # A module the FlashInfer wheel lacks would otherwise be compiled with nvcc, for minutes,
    # inside a timed benchmark; disabled, the case is reported as not available.
    os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    # tvm-ffi, which both peers call through, builds a torch DLPack add-on with a compiler at
    # import when this torch lacks the C exchange API; the add-on only speeds argument passing.
    if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
            or hasattr(torch.Tensor, "__c_dlpack_exchange_api__")):
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")


def import_peer(module: str):
    """The peer's module, or NotAvailable naming the module and why it did not import."""
    _peer_environment()
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or a shared library that does not load here
        raise NotAvailable(f"{module} is not importable: {type(e).__name__}: "
                           f"{_first_line(e)}") from e


def _dtype_name(case) -> str:
    return str(DTYPES[case.dtype]).removeprefix("torch.")


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer that fails the check wherever the peer does not write it."""
    return torch.full_like(t, float("nan"))


def contiguous_as_pages(case, inputs):
    """(k pages, v pages, block table, page size) for a decode case: the case's own pages,
    or a contiguous [B, L, Hkv, D] cache viewed as CONTIGUOUS_PAGE-token pages in order."""
    if case.page_size is not None:
        return inputs.k_cache, inputs.v_cache, inputs.block_table, case.page_size
    page = CONTIGUOUS_PAGE
    if case.L % page:
        raise NotAvailable(f"a contiguous cache is read as {page}-token pages, and "
                           f"L={case.L} is not a multiple of {page}")
    n_pages = case.B * case.L // page
    shape = (n_pages, page, case.HKV, case.D)
    table = torch.arange(n_pages, dtype=torch.int32, device=inputs.q.device)
    return (inputs.k_cache.view(shape), inputs.v_cache.view(shape),
            table.view(case.B, case.L // page), page)


CONTIGUOUS_NOTE = f"contiguous cache read as {CONTIGUOUS_PAGE}-token pages in order"


# --------------------------------------------------------------------------- FlashAttention-4

def fa4_kernel_name(case, page_size: int | None = None) -> str:
    """The FA4 AOT kernel a case needs (a key of the wheel's MANIFEST['kernels'])."""
    if case.op == "prefill":
        return f"prefill_d{case.D}_{'causal' if case.causal else 'full'}"
    return f"decode_paged_d{case.D}_gqa{case.HQ // case.HKV}_p{page_size}"


def fa4_wheel(dtype_name: str, device):
    """(the peer_fa4_aot module, its manifest) after the checks every FA4 column makes:
    the wheel imports, carries kernels of this dtype and was built for this GPU; else
    NotAvailable naming which."""
    fa4 = import_peer(FA4_MODULE)
    manifest = getattr(fa4, "MANIFEST", {})
    wheel_dtype = manifest.get("dtype", "bfloat16")
    if dtype_name != wheel_dtype:
        raise NotAvailable(f"the FA4 AOT wheel carries {wheel_dtype} kernels only, "
                           f"not {dtype_name}")
    target = manifest.get("target", "")
    if "sm_90" in target:
        device = torch.device(device)
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cc != (9, 0):
            where = f"sm_{cc[0]}{cc[1]}" if cc else f"inputs on {device}"
            raise NotAvailable(f"the FA4 AOT kernels are built for {target.split()[0]} "
                               f"GPUs, not {where}")
    return fa4, manifest


class Fa4Runner(Runner):
    """FlashAttention-4 SM90 forward kernels from the AOT wheel, called through
    ``peer_fa4_aot.forward(name, q, k, v, out, softmax_scale, ...)``."""

    name = "fa4"
    ops = ("prefill", "decode")

    def prepare(self, case, inp):
        fa4, manifest = fa4_wheel(_dtype_name(case), inp.q.device)
        kernels = manifest.get("kernels", {})
        notes = [f"flash-attn-4 {manifest.get('flash_attn_4', '?')} AOT"]
        if case.op == "prefill":
            name = _fa4_kernel(case, kernels)
            q, k, v = inp.q, inp.k, inp.v
            if case.H != case.HKV:
                group = case.H // case.HKV
                k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
                notes.append(f"K/V repeated to {case.H} heads (the FA4 AOT prefill kernels "
                             f"are MHA only)")
            kwargs = {}
            canon = _same
        else:
            k, v, table, page = contiguous_as_pages(case, inp)
            name = _fa4_kernel(case, kernels, page)
            if case.page_size is None:
                notes.append(CONTIGUOUS_NOTE)
            q = inp.q.unsqueeze(1)  # [B, 1, Hq, D]: one query token per sequence
            kwargs = {"seqused_k": inp.seqlens, "page_table": table}
            canon = _drop_token_dim
        out = _nan_like(q)
        scale = inp.scale

        def call():
            return fa4.forward(name, q, k, v, out, scale, **kwargs)

        return Prepared(call, call, canon, note="; ".join(notes))


def _fa4_kernel(case, kernels, page_size=None) -> str:
    name = fa4_kernel_name(case, page_size)
    if name not in kernels:
        raise NotAvailable(f"the FA4 AOT wheel has no kernel {name} "
                           f"(it carries {', '.join(sorted(kernels)) or 'none'})")
    return name


def _same(out):
    return out


def _drop_token_dim(out):
    return out[:, 0]


# --------------------------------------------------------------------------- FlashInfer

def _missing_module(exc: BaseException) -> bool:
    """FlashInfer's MissingJITCacheError: the wheel carries no module for this case."""
    return any(c.__name__ == "MissingJITCacheError" for c in type(exc).__mro__)


def _flashinfer_call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        if _missing_module(e):
            raise NotAvailable(f"{what}: the FlashInfer wheel carries no module for this case "
                               f"(JIT off): {_first_line(e)}") from e
        raise


class _FlashInferRunner(Runner):
    def __init__(self):
        self._workspaces = {}

    def _workspace(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._workspaces:
            self._workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspaces[key]


def ragged_prefill_plan(case, inp) -> dict:
    """Arguments of BatchPrefillWithRaggedKVCacheWrapper.plan for an equal-length batch
    written as ragged: B sequences of N query and N key rows, packed back to back."""
    indptr = torch.arange(case.B + 1, dtype=torch.int32, device=inp.q.device) * case.N
    dtype = DTYPES[case.dtype]
    return dict(qo_indptr=indptr, kv_indptr=indptr, num_qo_heads=case.H,
                num_kv_heads=case.HKV, head_dim_qk=case.D, causal=case.causal,
                sm_scale=inp.scale, q_data_type=dtype, kv_data_type=dtype)


class FlashInferPrefillRunner(_FlashInferRunner):
    """FlashInfer batch prefill on ragged Q/K/V [B*N, H, D] with one backend (fa2 or fa3)."""

    ops = ("prefill",)

    def __init__(self, backend: str):
        super().__init__()
        self.backend, self.name = backend, f"flashinfer-{backend}"

    def prepare(self, case, inp):
        fi = import_peer(FLASHINFER_MODULE)
        what = f"batch ragged prefill ({self.backend})"
        rows = case.B * case.N
        q = inp.q.view(rows, case.H, case.D)
        k = inp.k.view(rows, case.HKV, case.D)
        v = inp.v.view(rows, case.HKV, case.D)
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace(inp.q.device), "NHD", backend=self.backend)
        _flashinfer_call(what, wrapper.plan, **ragged_prefill_plan(case, inp))
        out = _nan_like(q)

        def call():
            return wrapper.run(q, k, v, out=out)

        shape = (case.B, case.N, case.H, case.D)
        return Prepared(lambda: _flashinfer_call(what, call), call,
                        lambda o: o.view(shape),
                        note=f"flashinfer {getattr(fi, '__version__', '?')}")


def paged_decode_plan(case, inp, table, page_size) -> dict:
    """Arguments of BatchDecodeWithPagedKVCacheWrapper.plan for full caches of L keys:
    sequence b owns pages table[b], the last one holding L - (pages - 1) * page_size keys."""
    pages_per_seq = table.shape[1]
    device = inp.q.device
    indptr = torch.arange(case.B + 1, dtype=torch.int32, device=device) * pages_per_seq
    last = torch.full((case.B,), case.L - (pages_per_seq - 1) * page_size, dtype=torch.int32,
                      device=device)
    dtype = DTYPES[case.dtype]
    return dict(indptr=indptr, indices=table.reshape(-1), last_page_len=last,
                num_qo_heads=case.HQ, num_kv_heads=case.HKV, head_dim=case.D,
                page_size=page_size, sm_scale=inp.scale, q_data_type=dtype,
                kv_data_type=dtype)


class FlashInferDecodeRunner(_FlashInferRunner):
    """FlashInfer paged decode, with tensor cores (its prefill kernel on a paged cache) or
    with CUDA cores (its decode kernel)."""

    ops = ("decode",)

    def __init__(self, name: str, tensor_cores: bool):
        super().__init__()
        self.name, self.tensor_cores = name, tensor_cores

    def prepare(self, case, inp):
        fi = import_peer(FLASHINFER_MODULE)
        what = f"paged decode ({'tensor' if self.tensor_cores else 'CUDA'} cores)"
        k, v, table, page = contiguous_as_pages(case, inp)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace(inp.q.device), "NHD", use_tensor_cores=self.tensor_cores)
        _flashinfer_call(what, wrapper.plan, **paged_decode_plan(case, inp, table, page))
        q, out = inp.q, _nan_like(inp.q)

        def call():
            return wrapper.run(q, (k, v), out=out)

        notes = [f"flashinfer {getattr(fi, '__version__', '?')}"]
        if case.page_size is None:
            notes.append(CONTIGUOUS_NOTE)
        return Prepared(lambda: _flashinfer_call(what, call), call, note="; ".join(notes))


def peer_runners() -> list[Runner]:
    """The peer runners, in the order the benchmark lists them."""
    return [Fa4Runner(), FlashInferPrefillRunner("fa3"), FlashInferPrefillRunner("fa2"),
            FlashInferDecodeRunner("flashinfer", tensor_cores=True),
            FlashInferDecodeRunner("flashinfer-cudacores", tensor_cores=False)]
