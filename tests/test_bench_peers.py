"""The peer runners of wsattn bench (FlashAttention-4 AOT, FlashInfer): 'not available' when
their wheels are absent, the arguments they pass checked against fakes that compute the
attention from those arguments on CPU, and (GPU) one real case per peer."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from wsattn import reference
from wsattn.bench import suite
from wsattn.bench.cases import DecodeCase, PrefillCase
from wsattn.bench.peers import (FA4_MODULE, FLASHINFER_MODULE, Fa4Runner, FlashInferDecodeRunner,
                                FlashInferPrefillRunner, import_peer, peer_runners)
from wsattn.bench.runners import (RUNNER_NAMES, NotAvailable, Prepared, Runner, check_output,
                                  make_inputs)
from wsattn.bench.timing import Timing

from conftest import CountingTimer as _CountingTimer

TIMING = Timing(median_ms=1.0, q20_ms=0.9, q80_ms=1.1, reps=20)
PEER_NAMES = ("fa4", "flashinfer-fa3", "flashinfer-fa2", "flashinfer", "flashinfer-cudacores")


def _stamp():
    return {"gpu": "none", "commit": "abc", "date": "2026-11-30T00:00:00Z", "torch": "x",
            "triton": "y"}


CountingTimer = functools.partial(_CountingTimer, TIMING)


class ReferenceRunner(Runner):
    """A runner that is always right, standing for the rest of a bench run."""
    name = "reference"
    ops = ("prefill", "decode")

    def prepare(self, case, inp):
        def call():
            if case.op == "prefill":
                out, _ = reference.attention(inp.q, inp.k, inp.v, case.causal, inp.scale)
            else:
                out, _ = reference.decode(inp.q, inp.k_cache, inp.v_cache, inp.seqlens,
                                          inp.block_table, inp.scale)
            return out.to(inp.q.dtype)
        return Prepared(call, call)


def _run(case, runners):
    timer = CountingTimer()
    rows = suite.run_cases([case], runners, timer, _stamp(), "cpu")
    return {r["impl"]: r for r in rows}, timer


# --------------------------------------------------------------------------- fakes

def fake_fa4(dtype="float32", kernels=("prefill_d64_full", "prefill_d64_causal",
                                       "prefill_d128_full", "decode_paged_d64_gqa4_p16")):
    """A peer_fa4_aot that records its calls and computes attention with the reference
    from exactly what it was given: dense q/k/v, or paged k/v through page_table and
    seqused_k. Like the real kernels it takes equal q/kv heads for prefill."""
    mod = types.ModuleType(FA4_MODULE)
    mod.MANIFEST = {"flash_attn_4": "4.0.0b36", "dtype": dtype, "target": "cpu (test fake)",
                    "kernels": {k: {} for k in kernels}}
    mod.calls = []

    def forward(name, q, k, v, out, softmax_scale, *, cu_seqlens_q=None, cu_seqlens_k=None,
                seqused_k=None, page_table=None):
        assert name in mod.MANIFEST["kernels"], name
        mod.calls.append(dict(name=name, q=tuple(q.shape), k=tuple(k.shape), out=out,
                              scale=softmax_scale, seqused_k=seqused_k, page_table=page_table,
                              cu_seqlens=(cu_seqlens_q, cu_seqlens_k)))
        if page_table is None:
            assert q.shape[2] == k.shape[2], "FA4 prefill kernels are MHA only"
            o, _ = reference.attention(q, k, v, name.endswith("_causal"), softmax_scale)
        else:
            assert name.endswith(f"_p{k.shape[1]}") and f"_gqa{q.shape[2] // k.shape[2]}_" in name
            keys = reference.gather_paged_kv(k, page_table, page_table.shape[1] * k.shape[1])
            vals = reference.gather_paged_kv(v, page_table, page_table.shape[1] * k.shape[1])
            o, _ = reference.decode(q[:, 0], keys, vals, seqused_k, None, softmax_scale)
            o = o.unsqueeze(1)
        out.copy_(o.to(out.dtype))
        return out

    mod.forward = forward
    return mod


class MissingJITCacheError(RuntimeError):
    """Stands for flashinfer.jit.core.MissingJITCacheError (matched by name)."""


def fake_flashinfer(missing=False, write=True):
    """A flashinfer module with the two wrappers the runners use, computing from the indptr /
    indices / last_page_len they were planned with. missing=True: plan raises
    MissingJITCacheError as the real one does for a module the wheel lacks."""
    mod = types.ModuleType(FLASHINFER_MODULE)
    mod.__version__ = "0.7.4"
    mod.wrappers = []

    class Wrapper:
        def __init__(self, workspace, kv_layout, **kwargs):
            assert kv_layout == "NHD" and workspace.dtype == torch.uint8
            self.init, self.planned, self.runs = kwargs, None, 0
            mod.wrappers.append(self)

        def _plan(self, **args):
            if missing:
                raise MissingJITCacheError("JIT disabled and module batch_prefill_x not in cache")
            self.planned = args

    class BatchPrefillWithRaggedKVCacheWrapper(Wrapper):
        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **kw):
            self._plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=num_qo_heads,
                       num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, **kw)

        def run(self, q, k, v, out=None):
            p = self.planned
            assert q.shape[1:] == (p["num_qo_heads"], p["head_dim_qk"])
            assert k.shape[1] == p["num_kv_heads"] and out.shape == q.shape
            self.runs += 1
            qo, kv = p["qo_indptr"].tolist(), p["kv_indptr"].tolist()
            for i in range(len(qo) - 1) if write else ():
                o, _ = reference.attention(q[None, qo[i]:qo[i + 1]], k[None, kv[i]:kv[i + 1]],
                                           v[None, kv[i]:kv[i + 1]], p["causal"], p["sm_scale"])
                out[qo[i]:qo[i + 1]] = o[0].to(out.dtype)
            return out

    class BatchDecodeWithPagedKVCacheWrapper(Wrapper):
        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, **kw):
            self._plan(indptr=indptr, indices=indices, last_page_len=last_page_len,
                       num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       page_size=page_size, **kw)

        def run(self, q, paged_kv_cache, out=None):
            p = self.planned
            k_cache, v_cache = paged_kv_cache
            assert k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"])
            assert q.shape[1] == p["num_qo_heads"] and out.shape == q.shape
            self.runs += 1
            indptr, indices = p["indptr"].tolist(), p["indices"]
            for b in range(len(indptr) - 1) if write else ():
                pages = indices[indptr[b]:indptr[b + 1]].long()
                n = (len(pages) - 1) * p["page_size"] + int(p["last_page_len"][b])
                keys = k_cache[pages].flatten(0, 1)[None, :n]
                vals = v_cache[pages].flatten(0, 1)[None, :n]
                o, _ = reference.decode(q[b:b + 1], keys, vals, torch.tensor([n]), None,
                                        p["sm_scale"])
                out[b] = o[0].to(out.dtype)
            return out

    mod.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    mod.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    return mod


# --------------------------------------------------------------------------- absent peers

PREFILL = PrefillCase(2, 33, 4, 2, 64, True, "fp32")
DECODE = DecodeCase(3, 77, 8, 2, 64, 16, "fp32")


def test_peers_are_registered_after_the_existing_runners():
    assert RUNNER_NAMES[:5] == ("wsattn", "triton", "gluon", "sdpa-cudnn", "sdpa-flash")
    assert RUNNER_NAMES[5:-2] == PEER_NAMES
    assert RUNNER_NAMES[-2:] == ("gluon-one-consumer", "gluon-multi-consumer")


@pytest.mark.parametrize("case, expected", [
    pytest.param(PREFILL, ("fa4", "flashinfer-fa3", "flashinfer-fa2"), id="prefill"),
    pytest.param(DECODE, ("fa4", "flashinfer", "flashinfer-cudacores"), id="decode-page16"),
])
def test_absent_peers_give_not_available_rows_and_the_run_goes_on(case, expected, monkeypatch):
    for module in (FA4_MODULE, FLASHINFER_MODULE):
        monkeypatch.setitem(sys.modules, module, None)  # import -> ImportError
    rows, timer = _run(case, [*peer_runners(), ReferenceRunner()])
    assert set(rows) == {*expected, "reference"}
    for name in expected:
        module = FA4_MODULE if name == "fa4" else FLASHINFER_MODULE
        assert rows[name]["status"] == "not available", rows[name]
        assert rows[name]["reason"] == (f"{module} is not importable: ModuleNotFoundError: "
                                        f"import of {module} halted; None in sys.modules")
    assert rows["reference"]["status"] == "ok" and timer.calls == 1


def test_import_wsattn_bench_needs_no_peer():
    """Listing the runners imports neither peer: both are imported inside prepare()."""
    code = ("import sys, wsattn.bench, wsattn.bench.cli\n"
            "from wsattn.bench.runners import all_runners\n"
            "all_runners()\n"
            f"print(sorted(m for m in ({FA4_MODULE!r}, {FLASHINFER_MODULE!r}, 'tvm_ffi')"
            " if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_missing_module_error_names_the_module(monkeypatch):
    monkeypatch.delitem(sys.modules, "wsattn_no_such_peer", raising=False)
    with pytest.raises(NotAvailable, match="wsattn_no_such_peer is not importable: "
                                           "ModuleNotFoundError: No module named"):
        import_peer("wsattn_no_such_peer")


# --------------------------------------------------------------------------- FA4, faked

@pytest.mark.parametrize("case", [
    pytest.param(PrefillCase(2, 33, 4, 4, 64, True, "fp32"), id="B2-S33-H4-D64-causal"),
    pytest.param(PrefillCase(1, 17, 4, 2, 128, False, "fp32"), id="B1-S17-H4-HKV2-D128-full"),
])
def test_fa4_prefill_calls_the_dense_kernel(case, monkeypatch):
    fa4 = fake_fa4()
    monkeypatch.setitem(sys.modules, FA4_MODULE, fa4)
    rows, timer = _run(case, [Fa4Runner()])
    row = rows["fa4"]
    assert row["status"] == "ok", row["reason"]
    assert row["rel_err"] < 1e-5 and timer.calls == 1
    first, timed = fa4.calls  # the checked call, then the timed one, into the same buffer
    assert first["name"] == f"prefill_d{case.D}_{'causal' if case.causal else 'full'}"
    assert first["q"] == (case.B, case.N, case.H, case.D)
    assert first["k"] == (case.B, case.N, case.H, case.D), "K/V carry H heads for FA4"
    assert first["scale"] == pytest.approx(1 / math.sqrt(case.D))
    assert first["page_table"] is None and first["cu_seqlens"] == (None, None)
    assert timed["out"] is first["out"]
    assert "flash-attn-4 4.0.0b36 AOT" in row["note"]
    assert ("K/V repeated to 4 heads" in row["note"]) == (case.HKV != case.H)


@pytest.mark.parametrize("case", [
    pytest.param(DecodeCase(3, 77, 8, 2, 64, 16, "fp32"), id="B3-L77-H8-HKV2-page16"),
    pytest.param(DecodeCase(2, 80, 8, 2, 64, None, "fp32"), id="B2-L80-H8-HKV2-contiguous"),
])
def test_fa4_decode_calls_the_paged_kernel(case, monkeypatch):
    fa4 = fake_fa4()
    monkeypatch.setitem(sys.modules, FA4_MODULE, fa4)
    runner = Fa4Runner()
    inp = make_inputs(case, "cpu")
    prepared = runner.prepare(case, inp)
    out = prepared.canon(prepared.first())
    assert check_output(inp, out).passed
    (call,) = fa4.calls
    assert call["name"] == "decode_paged_d64_gqa4_p16"
    assert call["q"] == (case.B, 1, case.HQ, case.D)
    assert call["seqused_k"] is inp.seqlens
    if case.page_size is None:  # the same memory as 16-token pages in order
        assert call["k"] == (case.B * case.L // 16, 16, case.HKV, case.D)
        assert torch.equal(call["page_table"].flatten(), torch.arange(case.B * case.L // 16,
                                                                      dtype=torch.int32))
        assert "contiguous cache read as 16-token pages" in prepared.note
    else:
        assert call["page_table"] is inp.block_table
        assert call["k"] == tuple(inp.k_cache.shape)


@pytest.mark.parametrize("case, why", [
    pytest.param(PrefillCase(1, 17, 2, 2, 32, True, "fp32"), "no kernel prefill_d32_causal",
                 id="head-dim-not-built"),
    pytest.param(DecodeCase(2, 100, 8, 2, 64, 64, "fp32"), "no kernel decode_paged_d64_gqa4_p64",
                 id="page64-not-built"),
    pytest.param(DecodeCase(2, 100, 8, 4, 64, 16, "fp32"), "no kernel decode_paged_d64_gqa2_p16",
                 id="gqa2-not-built"),
    pytest.param(DecodeCase(2, 77, 8, 2, 64, None, "fp32"), "L=77 is not a multiple of 16",
                 id="contiguous-odd-L"),
    pytest.param(PrefillCase(1, 17, 2, 2, 64, True, "fp16"), "float32 kernels only, not float16",
                 id="dtype-not-built"),
    pytest.param(PrefillCase(1, 17, 2, 2, 64, True, "fp32"),
                 "built for sm_90a GPUs, not inputs on cpu", id="target-sm90"),
])
def test_fa4_case_outside_the_wheel_is_not_available(case, why, monkeypatch):
    fa4 = fake_fa4()
    if "sm_90a" in why:
        fa4.MANIFEST["target"] = "sm_90a (FLASH_ATTENTION_ARCH=sm_90)"
    monkeypatch.setitem(sys.modules, FA4_MODULE, fa4)
    rows, timer = _run(case, [Fa4Runner(), ReferenceRunner()])
    assert rows["fa4"]["status"] == "not available" and why in rows["fa4"]["reason"]
    assert rows["reference"]["status"] == "ok" and fa4.calls == []


# --------------------------------------------------------------------------- FlashInfer, faked

@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("case", [
    pytest.param(PrefillCase(2, 33, 4, 2, 64, True, "fp32"), id="B2-S33-H4-HKV2-D64-causal"),
    pytest.param(PrefillCase(3, 17, 2, 2, 64, False, "fp32"), id="B3-S17-H2-D64-full"),
])
def test_flashinfer_prefill_plans_an_equal_length_batch_as_ragged(case, backend, monkeypatch):
    fi = fake_flashinfer()
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fi)
    rows, timer = _run(case, [FlashInferPrefillRunner(backend)])
    row = rows[f"flashinfer-{backend}"]
    assert row["status"] == "ok", row["reason"]
    assert row["rel_err"] < 1e-5 and row["note"] == "flashinfer 0.7.4"
    (w,) = fi.wrappers
    assert w.init == {"backend": backend} and w.runs == 2  # checked, then timed
    p = w.planned
    indptr = [i * case.N for i in range(case.B + 1)]
    assert p["qo_indptr"].tolist() == indptr and p["kv_indptr"].tolist() == indptr
    assert p["qo_indptr"].dtype == torch.int32
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"]) == (case.H, case.HKV, case.D)
    assert p["causal"] == case.causal and p["sm_scale"] == pytest.approx(case.D ** -0.5)
    assert p["q_data_type"] == p["kv_data_type"] == torch.float32


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("case", [
    pytest.param(DecodeCase(3, 77, 8, 2, 64, 16, "fp32"), id="B3-L77-H8-HKV2-page16"),
    pytest.param(DecodeCase(2, 100, 8, 1, 64, 64, "fp32"), id="B2-L100-H8-HKV1-page64"),
    pytest.param(DecodeCase(2, 80, 8, 2, 64, None, "fp32"), id="B2-L80-H8-HKV2-contiguous"),
])
def test_flashinfer_decode_plans_the_page_table(case, tensor_cores, monkeypatch):
    fi = fake_flashinfer()
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fi)
    name = "flashinfer" if tensor_cores else "flashinfer-cudacores"
    inp = make_inputs(case, "cpu")
    runner = FlashInferDecodeRunner(name, tensor_cores)
    (row,) = suite.run_cases([case], [runner], CountingTimer(), _stamp(), "cpu")
    assert row["status"] == "ok", row["reason"]
    (w,) = fi.wrappers
    assert w.init == {"use_tensor_cores": tensor_cores}
    p = w.planned
    page = case.page_size or 16
    pages = -(-case.L // page)
    assert p["indptr"].tolist() == [b * pages for b in range(case.B + 1)]
    assert p["last_page_len"].tolist() == [case.L - (pages - 1) * page] * case.B
    assert p["page_size"] == page and p["sm_scale"] == pytest.approx(case.D ** -0.5)
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim"]) == (case.HQ, case.HKV, case.D)
    if case.page_size is None:
        assert p["indices"].tolist() == list(range(case.B * pages))
        assert "contiguous cache read as 16-token pages" in row["note"]
    else:  # the same random page placement as the inputs (same seed)
        assert torch.equal(p["indices"], inp.block_table.flatten())


def test_flashinfer_module_missing_from_the_wheel_is_not_available(monkeypatch):
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fake_flashinfer(missing=True))
    rows, _ = _run(PREFILL, [FlashInferPrefillRunner("fa3"), ReferenceRunner()])
    assert rows["flashinfer-fa3"]["status"] == "not available"
    assert "carries no module for this case" in rows["flashinfer-fa3"]["reason"]
    assert rows["reference"]["status"] == "ok"


@pytest.mark.parametrize("case", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_peer_output_left_unwritten_fails_the_check(case, monkeypatch):
    """The peers' output buffers start as NaN, so a peer that writes nothing fails."""
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fake_flashinfer(write=False))
    runner = (FlashInferPrefillRunner("fa2") if case.op == "prefill"
              else FlashInferDecodeRunner("flashinfer", True))
    (row,) = suite.run_cases([case], [runner], CountingTimer(), _stamp(), "cpu")
    assert row["status"] == "failed" and row["rel_err"] == math.inf


def test_peer_environment_turns_flashinfer_jit_off(monkeypatch):
    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    monkeypatch.delenv("TVM_FFI_DISABLE_TORCH_C_DLPACK", raising=False)
    monkeypatch.setitem(sys.modules, FLASHINFER_MODULE, fake_flashinfer())
    import_peer(FLASHINFER_MODULE)
    assert os.environ["FLASHINFER_DISABLE_JIT"] == "1"
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "0")  # an explicit choice is kept
    import_peer(FLASHINFER_MODULE)
    assert os.environ["FLASHINFER_DISABLE_JIT"] == "0"


# --------------------------------------------------------------------------- on the GPU

def _need(module):
    # The peers are optional wheels, not dependencies: skip only when the module does not
    # import here (NotAvailable from import_peer); once it imports, every failure of the
    # runner is the test's to report.
    try:
        import_peer(module)
    except NotAvailable as e:
        pytest.skip(f"optional peer wheel not installed here: {e}")


GPU_CASES = {
    "fa4": [PrefillCase(2, 300, 4, 4, 128, True), PrefillCase(1, 257, 8, 8, 64, False),
            DecodeCase(2, 1000, 32, 8, 128, 16), DecodeCase(2, 1024, 32, 8, 128, None)],
    "flashinfer-fa3": [PrefillCase(2, 300, 8, 2, 128, True), PrefillCase(1, 257, 8, 8, 64, False)],
    "flashinfer-fa2": [PrefillCase(2, 300, 8, 2, 128, True), PrefillCase(1, 257, 8, 8, 64, False)],
    "flashinfer": [DecodeCase(2, 1000, 32, 8, 128, 16), DecodeCase(2, 1024, 32, 8, 128, None)],
    "flashinfer-cudacores": [DecodeCase(2, 1000, 32, 8, 128, 16),
                             DecodeCase(2, 1024, 32, 8, 128, None)],
}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("name", PEER_NAMES)
def test_peer_runs_checked_and_timed_on_the_gpu(name):
    """Each peer through the bench's own path (check, then graph timing) on bf16 cases of
    the shapes its wheel carries, partial last page and contiguous cache included."""
    from wsattn.bench.timing import cuda_timer

    _need(FA4_MODULE if name == "fa4" else FLASHINFER_MODULE)
    (runner,) = [r for r in peer_runners() if r.name == name]
    timer = cuda_timer(warmup_ms=2, rep_ms=5)
    rows = suite.run_cases(GPU_CASES[name], [runner], timer, _stamp(), "cuda")
    assert len(rows) == len(GPU_CASES[name])
    for row in rows:
        assert row["status"] == "ok", (row["case"], row["reason"])
        assert row["rel_err"] < row["tol"] and row["median_ms"] > 0
