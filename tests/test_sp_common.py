"""Machinery of the sequence-parallel tests (no tests here): spawn a process group, run
a battery of checks on every rank, bring back each rank's verdicts.

Each battery builds the GLOBAL inputs from one seed on every rank, shards them, runs
the sp entry point, and compares this rank's piece with the same piece of the
single-device float64 reference. A battery returns {check name: None (passed), a
failure message, or a tensor the parent compares across runs}. Spawning costs a few
seconds per process, so one group runs many checks.
"""

from __future__ import annotations

import math
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import LSE_TOL, TOL, rel_err

SPAWN_TIMEOUT_S = 150


# --------------------------------------------------------------------------- harness

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, queue, battery, env, backend):
    os.environ.update(env)
    results = {}
    try:
        if env.get("TRITON_INTERPRET") == "1":
            from wsattn._triton_compat import patch_interpreter
            patch_interpreter()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=120))
        results = BATTERIES[battery](rank, world)
    except BaseException:  # noqa: BLE001 - the parent reports it
        results = {"crash": traceback.format_exc()}
    # Tensors would travel as shared-memory handles that die with this process: send bytes.
    results = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in results.items()}
    queue.put((rank, results))
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip teardown: a deliberately broken group must not hang the exit


def run_group(battery: str, world: int, env=None, backend="gloo", timeout_s=SPAWN_TIMEOUT_S):
    """Run BATTERIES[battery] on `world` spawned ranks; returns [results of rank r]."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    env = {"WSATTN_POISON": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, queue, battery, env, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world:
            try:
                rank, res = queue.get(timeout=0.2)
                out[rank] = res
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
            if dead:
                raise AssertionError(f"{battery} on {world} ranks: rank(s) {dead} died "
                                     f"(exit codes {[procs[r].exitcode for r in dead]})")
            if time.monotonic() > deadline:
                raise AssertionError(f"{battery} on {world} ranks: only ranks {sorted(out)} "
                                     f"reported within {timeout_s} s (a hang)")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    import numpy as np
    return [{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v)
             for k, v in out[r].items()} for r in range(world)]


def failures(results) -> list[str]:
    """Every failing check of every rank, as readable lines."""
    bad = []
    for r, res in enumerate(results):
        for name, verdict in res.items():
            if isinstance(verdict, str):
                bad.append(f"rank {r} {name}: {verdict}")
    return bad


def _run_check(results, name, fn):
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001
        results[name] = traceback.format_exc(limit=6)
    if os.environ.get("WSATTN_SP_TEST_TIMES"):
        print(f"{name}: {time.perf_counter() - t0:.2f} s", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- comparisons

def _cmp(out, ref, dtype, what):
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.1e}"


def _cmp_lse(lse, ref, dtype, what):
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert not torch.isnan(lse).any(), f"{what}: lse has NaN"
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), fin), f"{what}: lse -inf pattern differs"
    if fin.any():
        err = (lse[fin] - ref[fin]).abs().max().item()
        assert err <= LSE_TOL[dtype] * max(1.0, ref[fin].abs().max().item()), \
            f"{what}: lse max abs error {err:.3e}"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(g, *shape, dtype, device):
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).to(device)


# --------------------------------------------------------------------------- checks

def check_prefill(rank, W, *, B, Sq, Sk, Hq, Hkv, D, causal, zigzag, overlapped, impl, dtype,
                  device, seed, transport="p2p"):
    """sp.prefill (or prefill_overlapped) of this rank's shard == the reference's shard."""
    import wsattn.sp as sp
    from wsattn import reference
    from wsattn.sp.sharding import shard
    g = _gen(seed)
    q = _rand(g, B, Sq, Hq, D, dtype=dtype, device=device)
    k = _rand(g, B, Sk, Hkv, D, dtype=dtype, device=device)
    v = _rand(g, B, Sk, Hkv, D, dtype=dtype, device=device)
    ref, ref_lse = reference.attention(q, k, v, causal)
    kw = dict(transport=transport) if overlapped else {}
    fn = sp.prefill_overlapped if overlapped else sp.prefill
    out, lse = fn(shard(q, W, rank, 1, zigzag), shard(k, W, rank, 1, zigzag),
                  shard(v, W, rank, 1, zigzag), causal, impl=impl, zigzag=zigzag, **kw)
    assert out.shape == (B, Sq // W, Hq, D) and lse.shape == (B, Hq, Sq // W)
    _cmp(out, shard(ref, W, rank, 1, zigzag), dtype, "out")
    _cmp_lse(lse, shard(ref_lse, W, rank, 2, zigzag), dtype, "lse")


def check_prefill_varlen(rank, W, *, lq, lk, Hq, Hkv, D, causal, zigzag, impl, dtype, device,
                         seed, give_max=False, check=True):
    """sp.prefill_varlen of packed sequences (some with a cached prefix) == the reference."""
    import wsattn.sp as sp
    from wsattn import reference
    from wsattn.sp.sharding import shard_varlen
    g = _gen(seed)
    cq = [0] + list(torch.tensor(lq).cumsum(0).tolist())
    ck = [0] + list(torch.tensor(lk).cumsum(0).tolist())
    q = _rand(g, cq[-1], Hq, D, dtype=dtype, device=device)
    k = _rand(g, ck[-1], Hkv, D, dtype=dtype, device=device)
    v = _rand(g, ck[-1], Hkv, D, dtype=dtype, device=device)
    ref, ref_lse = reference.attention_varlen(q, k, v, torch.tensor(cq),
                                              torch.tensor(ck), causal)
    q_loc, cq_loc = shard_varlen(q, cq, W, rank, zigzag)
    k_loc, ck_loc = shard_varlen(k, ck, W, rank, zigzag)
    v_loc, _ = shard_varlen(v, ck, W, rank, zigzag)
    kw = dict(max_seqlen_q=max(lq), max_seqlen_k=max(lk)) if give_max else {}
    out, lse = sp.prefill_varlen(q_loc, k_loc, v_loc, cq_loc, ck_loc, causal=causal,
                                 zigzag=zigzag, impl=impl, check=check, **kw)
    ref_loc, _ = shard_varlen(ref, cq, W, rank, zigzag)
    lse_loc, _ = shard_varlen(ref_lse.transpose(0, 1), cq, W, rank, zigzag)
    _cmp(out, ref_loc, dtype, "out")
    _cmp_lse(lse, lse_loc.transpose(0, 1), dtype, "lse")


def check_decode(rank, W, *, lens, Hq, Hkv, D, page, impl, dtype, device, seed,
                 exchange="allgather"):
    """sp.decode over paged shards (empty ones included) == the reference, on every rank."""
    import wsattn.sp as sp
    from wsattn import reference
    from wsattn.sp.sharding import shard_kv_cache
    g = _gen(seed)
    B, L = len(lens), max(lens)
    q = _rand(g, B, Hq, D, dtype=dtype, device=device)
    k = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    v = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    ref, ref_lse = reference.decode(q, k, v, seqlens)
    kp, vp, table, local = shard_kv_cache(k, v, lens, W, rank, page, seed)
    out, lse = sp.decode(q, kp, vp, local, table, impl=impl, exchange=exchange, return_lse=True)
    _cmp(out, ref, dtype, "out")
    _cmp_lse(lse, ref_lse, dtype, "lse")
    return (local == 0).any().item()


def check_decode_exact_contiguous(rank, W, *, lens, Hq, Hkv, D, impl, dtype, device, seed):
    """sp.decode over exact-size contiguous shards [B, L_local, Hkv, D]: a rank holding no
    key of any sequence passes L_local = 0 and seqlens all 0. Returns L_local."""
    import wsattn.sp as sp
    from wsattn import reference
    g = _gen(seed)
    B, L = len(lens), max(lens)
    q = _rand(g, B, Hq, D, dtype=dtype, device=device)
    k = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    v = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    ref, ref_lse = reference.decode(q, k, v, torch.tensor(lens, dtype=torch.int32))
    spans = [(n * rank // W, n * (rank + 1) // W) for n in lens]
    L_loc = max(e - a for a, e in spans)
    k_loc = torch.zeros(B, L_loc, Hkv, D, dtype=dtype, device=device)
    v_loc = torch.zeros_like(k_loc)
    for b, (a, e) in enumerate(spans):
        k_loc[b, :e - a], v_loc[b, :e - a] = k[b, a:e], v[b, a:e]
    local = torch.tensor([e - a for a, e in spans], dtype=torch.int32, device=device)
    out, lse = sp.decode(q, k_loc, v_loc, local, impl=impl, exchange="allgather",
                         return_lse=True)
    _cmp(out, ref, dtype, "out")
    _cmp_lse(lse, ref_lse, dtype, "lse")
    return L_loc


def _decode_no_key_rank(rank, W, **kw):
    """A rank with no key (L_max = 0) failed naming seqlens[0]=1, a length never passed."""
    # lens [1, W-1]: rank 0 holds nothing of either sequence, the others one key each
    L_loc = check_decode_exact_contiguous(rank, W, lens=[1, max(W - 1, 1)], **kw)
    assert (L_loc == 0) == (rank == 0), f"rank {rank} holds L_local = {L_loc}"


def invariant_output(rank, W, *, impl, dtype, device, seed=7, lens=(300, 1, 129, 64),
                     block_tokens=32, n_blocks=12, Hq=4, Hkv=2, D=64, page=16, group=None):
    """sp.invariant_decode's output (checked against the reference) for the parent to
    compare bitwise across rank counts."""
    import wsattn.sp as sp
    from wsattn import reference
    from wsattn.sp.sharding import shard_kv_cache_blocks
    g = _gen(seed)
    B, L = len(lens), max(lens)
    q = _rand(g, B, Hq, D, dtype=dtype, device=device)
    k = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    v = _rand(g, B, L, Hkv, D, dtype=dtype, device=device)
    kp, vp, table, blens = shard_kv_cache_blocks(k, v, lens, W, rank, n_blocks, block_tokens, page)
    out, lse = sp.invariant_decode(q, kp, vp, blens, table, n_blocks, impl=impl, return_lse=True,
                                   group=group)
    ref, ref_lse = reference.decode(q, k, v, torch.tensor(lens, dtype=torch.int32))
    _cmp(out, ref, dtype, "out")
    _cmp_lse(lse, ref_lse, dtype, "lse")
    return torch.cat([out.float().cpu().flatten(), lse.cpu().flatten()])


def expect_error(fn, exc, *needles):
    """fn must raise exc whose text holds every needle; returns None when it does."""
    try:
        fn()
    except exc as e:
        text = str(e)
        missing = [n for n in needles if n not in text]
        assert not missing, f"error text lacks {missing}: {text}"
        return None
    raise AssertionError(f"expected {exc.__name__}, nothing was raised")


# Collectives of the bad-input cases time out after this long (their own group) and so
# does the agreement: a rank that raised locally while its peers went on into a
# collective fails the case in seconds, instead of after the 120 s of the main group.
BAD_INPUT_TIMEOUT_S = 10


def expect_shard_error(fn, *needles):
    """fn must raise ShardError naming every needle, well before a peer could time out."""
    import wsattn.sp as sp
    t0 = time.monotonic()
    expect_error(fn, sp.ShardError, *needles)
    took = time.monotonic() - t0
    assert took < BAD_INPUT_TIMEOUT_S / 2, f"ShardError came after {took:.1f} s"


# --------------------------------------------------------------------------- batteries

def _prefill_cases(W):
    """(name, kwargs) of the prefill checks; every sequence splits into 2W chunks."""
    c = 2 * W
    base = dict(Hq=4, Hkv=1, D=16)
    cases = []
    for overlapped in (False, True):
        tag = "overlap" if overlapped else "gather"
        cases += [
            (f"{tag}-B2-S{5 * c}-H4-HKV1-zigzag-causal",
             dict(B=2, Sq=5 * c, Sk=5 * c, causal=True, zigzag=True, **base)),
            (f"{tag}-B1-S{3 * c}-H4-HKV4-zigzag-full",
             dict(B=1, Sq=3 * c, Sk=3 * c, causal=False, zigzag=True, Hq=4, Hkv=4, D=16)),
            (f"{tag}-B1-S{7 * W}-H4-HKV1-contiguous-causal",
             dict(B=1, Sq=7 * W, Sk=7 * W, causal=True, zigzag=False, **base)),
            (f"{tag}-B2-Sq{3 * c}-Sk{7 * c}-H8-HKV2-zigzag-causal-prefix",
             dict(B=2, Sq=3 * c, Sk=7 * c, causal=True, zigzag=True, Hq=8, Hkv=2, D=16)),
            (f"{tag}-B1-Sq{2 * W}-Sk{9 * W}-H4-HKV1-contiguous-causal-prefix",
             dict(B=1, Sq=2 * W, Sk=9 * W, causal=True, zigzag=False, **base)),
            (f"{tag}-B1-S{c}-H4-HKV1-zigzag-causal-one-token-chunks",
             dict(B=1, Sq=c, Sk=c, causal=True, zigzag=True, **base)),
        ]
    return cases


def _varlen_cases(W):
    c = 2 * W
    return [
        ("varlen-zigzag-causal-prefix", dict(lq=[3 * c, c, 2 * c], lk=[3 * c, 3 * c, 5 * c],
                                             causal=True, zigzag=True)),
        ("varlen-zigzag-causal-maxgiven-nocheck", dict(lq=[c, 4 * c], lk=[c, 4 * c], causal=True,
                                                       zigzag=True, give_max=True, check=False)),
        ("varlen-contiguous-causal-prefix", dict(lq=[2 * W, 5 * W], lk=[4 * W, 5 * W],
                                                 causal=True, zigzag=False)),
        ("varlen-zigzag-full-empty-seq", dict(lq=[2 * c, 0, c], lk=[2 * c, c, 3 * c],
                                              causal=False, zigzag=True)),
    ]


def battery_main(rank, W):
    """Every mode against the reference (impl='reference', fp32), then bad input."""
    import wsattn.sp as sp
    res = {}
    kw = dict(impl="reference", dtype=torch.float32, device="cpu")
    for i, (name, case) in enumerate(_prefill_cases(W)):
        _run_check(res, name, lambda: check_prefill(rank, W, **case, **kw, seed=i,
                                                    overlapped=name.startswith("overlap")))
    for i, (name, case) in enumerate(_varlen_cases(W)):
        _run_check(res, name, lambda: check_prefill_varlen(rank, W, Hq=4, Hkv=2, D=16, **case,
                                                           **kw, seed=100 + i))
    empty_seen = {}

    def decode_case():
        empty_seen["any"] = check_decode(rank, W, lens=[13 * W + 5, 1, 2 * W + 1, 40], Hq=8,
                                         Hkv=2, D=16, page=4, seed=200, **kw)
        # the 1-token sequence leaves ranks 0..W-2 with nothing of it
        assert empty_seen["any"] or rank == W - 1, "this rank was meant to hold an empty shard"
    _run_check(res, "decode-B4-H8-HKV2-paged-empty-shards", decode_case)
    _run_check(res, "decode-B1-H4-HKV4-auto-exchange",
               lambda: check_decode(rank, W, lens=[50], Hq=4, Hkv=4, D=16, page=8, seed=201,
                                    exchange="auto", **kw) and None)

    _run_check(res, "decode-contiguous-exact-size-rank-without-keys",
               lambda: _decode_no_key_rank(rank, W, Hq=8, Hkv=2, D=16, seed=202, **kw))

    def exchange_fallback():
        ex = sp.StateExchange.get(torch.distributed.group.WORLD, (4, 8, 17), torch.device("cpu"))
        assert ex.method == "allgather" and "needs CUDA" in (ex.fallback_reason or ""), ex.fallback_reason
    _run_check(res, "decode-exchange-falls-back-on-gloo", exchange_fallback)
    res.update(battery_bad_input(rank, W))
    return res


def battery_three_ranks(rank, W):
    """The reference battery, then the SP benchmark's plumbing at toy sizes on gloo."""
    res = battery_main(rank, W)

    def bench_smoke():
        import argparse
        import json
        import tempfile
        from wsattn.sp import bench
        path = os.path.join(tempfile.gettempdir(), f"wsattn_sp_bench_{os.getppid()}.json")
        args = argparse.Namespace(quick=True, dtype="bf16", json=path, sp_what=None,
                                  sp_seqlens=[12 * W], sp_contexts=[64 * W], sp_batches=[1, 3],
                                  sp_no_zigzag=False,
                                  sp_reps=1)
        assert bench.main(args) == 0, "a bench row was wrong"
        if rank == 0:
            rows = json.load(open(path))
            modes = {(r["what"], r["mode"]) for r in rows}
            for want in [("prefill", "overlapped"), ("prefill", "hidden_fraction"),
                         ("exchange", "allgather"), ("decode", "sp_invariant_decode")]:
                assert want in modes, f"no {want} row in {sorted(modes)}"
            assert all(r["world_size"] == W and r["commit"] for r in rows)
            decode_batches = {r["B"] for r in rows if r["what"] == "decode" and r["mode"] == "sp_decode"}
            assert decode_batches == {1, 3}, decode_batches
            assert rows[-1]["what"] == "run" and rows[-1]["complete"] is True, rows[-1]
    _run_check(res, "bench-smoke", bench_smoke)
    return res


def battery_bad_input(rank, W):
    """Each bad input raises the same error on every rank, and nobody hangs."""
    import wsattn.sp as sp
    from wsattn.sp.sharding import shard_kv_cache_blocks
    res = {}
    x = lambda *s: torch.randn(*s)  # noqa: E731
    ref = dict(impl="reference")

    # shard sizes that disagree: rank 0 holds 2W more query tokens
    sq = 4 if rank else 4 + 2 * W
    _run_check(res, "bad-shard-sizes-disagree", lambda: expect_error(
        lambda: sp.prefill(x(1, sq, 2, 16), x(1, 4, 2, 16), x(1, 4, 2, 16), causal=False, **ref),
        sp.ShardError, "q shard length", "rank 0: " + str(4 + 2 * W)))
    # a shard that cannot be split into zig-zag's two chunks, on every rank
    _run_check(res, "bad-zigzag-odd-shard", lambda: expect_error(
        lambda: sp.prefill(x(1, 3, 2, 16), x(1, 3, 2, 16), x(1, 3, 2, 16), **ref),
        sp.ShardError, "zig-zag", str(2 * W)))
    # shards cut for a group twice as large (global length 4 * 4W): a group of the wrong size
    _run_check(res, "bad-prefill-group-size", lambda: expect_error(
        lambda: sp.prefill_overlapped(x(1, 4, 2, 16), x(1, 4, 2, 16), x(1, 4, 2, 16),
                                      global_seqlen=8 * W, **ref),
        sp.ShardError, f"process group has {W} ranks", "another group size"))
    # the symmetric-memory transport asked for on a CPU group
    _run_check(res, "bad-symm-transport-on-gloo", lambda: expect_error(
        lambda: sp.prefill_overlapped(x(1, 4, 2, 16), x(1, 4, 2, 16), x(1, 4, 2, 16),
                                      transport="symm", **ref),
        ValueError, "transport='symm' unavailable"))
    # a tensor on the wrong device on the last rank only: every rank names that rank
    dev = "meta" if rank == W - 1 else "cpu"
    _run_check(res, "bad-device-one-rank", lambda: expect_error(
        lambda: sp.prefill(torch.empty(1, 4, 2, 16, device=dev), x(1, 4, 2, 16), x(1, 4, 2, 16),
                           **ref),
        sp.ShardError, f"rank {W - 1}", "meta"))
    # decode shards with mismatched batch across ranks
    bq = 2 if rank else 3
    _run_check(res, "bad-decode-batch-disagrees", lambda: expect_error(
        lambda: sp.decode(x(bq, 4, 16), x(4, 8, 2, 16), x(4, 8, 2, 16),
                          torch.ones(bq, dtype=torch.int32), torch.zeros(bq, 1, dtype=torch.int32),
                          **ref),
        sp.ShardError, "batch"))

    # a local length past the cache's capacity on rank 0 only
    lens = torch.tensor([9 if rank == 0 else 3], dtype=torch.int32)
    _run_check(res, "bad-decode-capacity-one-rank", lambda: expect_error(
        lambda: sp.decode(x(1, 4, 16), x(2, 4, 2, 16), x(2, 4, 2, 16), lens,
                          torch.zeros(1, 2, dtype=torch.int32), **ref),
        sp.ShardError, "rank 0", "capacity"))

    # invariant-decode shards built for 2W ranks, used on a group of W: wrong group size
    def wrong_group():
        k = x(1, 64, 2, 16)
        # 4W blocks, so that the shards cut for 2W ranks (2 slots) differ from W's (4)
        kp, vp, table, blens = shard_kv_cache_blocks(k, k, [64], 2 * W, rank, 4 * W, 8, 4)
        sp.invariant_decode(x(1, 4, 16), kp, vp, blens, table, 8, **ref)
    _run_check(res, "bad-invariant-group-size", lambda: expect_error(
        wrong_group, sp.ShardError, "group of size", "another number of ranks"))

    # invariant-decode shards of W blocks decoded as W - 1: the last rank's block (keys in
    # a slot past n_blocks) would be dropped by the merge; refused on every rank instead
    def keys_past_n_blocks():
        k = x(1, 8 * W, 2, 16)
        kp, vp, table, blens = shard_kv_cache_blocks(k, k, [8 * W], W, rank, W, 8, 4)
        sp.invariant_decode(x(1, 4, 16), kp, vp, blens, table, W - 1, **ref)
    _run_check(res, "bad-invariant-keys-past-n-blocks", lambda: expect_error(
        keys_past_n_blocks, sp.ShardError, f"rank {W - 1}", "past the"))
    res.update(_bad_input_one_rank(rank, W))
    return res


def _bad_input_one_rank(rank, W, device="cpu"):
    """What the single-GPU API refuses, on ONE rank only: every rank must raise the same
    ShardError naming that rank and the problem. These used to raise a plain ValueError
    on the bad rank alone, its peers blocked in the next collective until the process
    group's timeout. The bad rank moves from case to case, so rank 0 and the others
    both take the bad side."""
    import wsattn.sp as sp
    from wsattn.sp.sharding import shard_kv_cache_blocks
    from wsattn.target import interpreting
    res = {}
    kw_ref = dict(impl="reference", timeout_s=BAD_INPUT_TIMEOUT_S)
    x = lambda *s, dtype=torch.float32: torch.randn(*s, dtype=dtype, device=device)  # noqa: E731
    B, Hq, Hkv, D, page = 2, 4, 2, 16, 4
    cases = []

    def case(name, bad_fn, good_fn, *needles):
        cases.append((name, bad_fn, good_fn, needles))

    # ---- decode (paged unless said otherwise; reference kernels)
    lens = torch.tensor([5, 3], dtype=torch.int32, device=device)
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32, device=device)

    def dec(q=None, k=None, v=None, seqlens=None, bt=None, paged=True, **extra):
        q = x(B, Hq, D) if q is None else q
        k = x(4, page, Hkv, D) if k is None else k
        v = torch.randn_like(k) if v is None else v
        return lambda group: sp.decode(q, k, v, lens if seqlens is None else seqlens,
                                       (table if bt is None else bt) if paged else None,
                                       group=group, **{"exchange": "allgather", **kw_ref, **extra})
    case("decode-contiguous-cache-batch", dec(k=x(B + 1, 8, Hkv, D), paged=False),
         dec(k=x(B, 8, Hkv, D), paged=False), "contiguous k_cache must be [B=2")
    case("decode-v-pages-unlike-k", dec(k=x(4, page, Hkv, D), v=x(5, page, Hkv, D)),
         dec(), "k_cache and v_cache must have the same shape")
    case("decode-q-last-dim-stride", dec(q=x(B, Hq, 2 * D)[..., ::2]), dec(),
         "q must have a contiguous last dimension")
    case("decode-q-dtype-unlike-cache", dec(q=x(B, Hq, D, dtype=torch.float16)), dec(),
         "dtype")
    case("decode-dtype-unlike-peers",
         dec(q=x(B, Hq, D, dtype=torch.float64), k=x(4, page, Hkv, D, dtype=torch.float64)),
         dec(), "dtype must be the same on every rank")
    case("decode-block-table-int64", dec(bt=table.long()), dec(), "block_table must be int32")
    case("decode-seqlens-int64", dec(seqlens=lens.long()), dec(), "seqlens must be int32")
    case("decode-head-dim-unlike-q", dec(k=x(4, page, Hkv, 2 * D)), dec(),
         f"k_cache head dim must be D={D}")
    case("decode-num-splits-zero", dec(num_splits=0), dec(), "num_splits")
    case("decode-sm-scale-negative", dec(sm_scale=-1.0), dec(), "sm_scale")
    case("decode-exchange-unknown", dec(exchange="bogus"), dec(), "exchange must be one of")
    case("decode-impl-unknown", dec(impl="fast"), dec(), "impl must be one of")
    case("decode-timeout-not-a-number", dec(timeout_s="30"), dec(),
         "timeout_s must be None or a positive finite number")
    case("decode-sm-scale-unlike-peers", dec(sm_scale=2.0), dec(),
         "sm_scale must be the same on every rank")
    case("decode-return-lse-not-bool", dec(return_lse="False"), dec(),
         "return_lse must be a bool")

    # ---- invariant decode (W-independent shards: one block per rank's slot)
    def inv(bt_dtype=torch.int32, n_blocks=None, **extra):
        k = torch.randn(1, 8 * W, Hkv, D, generator=_gen(5)).to(device)
        kp, vp, bt, blens = shard_kv_cache_blocks(k, k, [8 * W], W, rank, W, 8, page)
        return lambda group: sp.invariant_decode(x(1, Hq, D), kp, vp, blens, bt.to(bt_dtype),
                                                 W if n_blocks is None else n_blocks,
                                                 group=group, **{**kw_ref, **extra})
    case("invariant-block-table-int64", inv(bt_dtype=torch.int64), inv(),
         "block_table must be int32")
    case("invariant-n-blocks-float", inv(n_blocks=float(W)), inv(),
         "n_blocks must be a positive int")
    case("invariant-sm-scale-nan", inv(sm_scale=float("nan")), inv(), "sm_scale")
    case("invariant-return-lse-not-bool", inv(return_lse="False"), inv(),
         "return_lse must be a bool")

    # ---- fixed-length prefill, both paths
    S = 4

    def pre(q=None, k=None, v=None, overlapped=False, **extra):
        q = x(1, S, Hq, D) if q is None else q
        k = x(1, S, Hkv, D) if k is None else k
        v = torch.randn_like(k) if v is None else v
        fn = sp.prefill_overlapped if overlapped else sp.prefill
        return lambda group: fn(q, k, v, group=group, **{**kw_ref, **extra})
    for ov, tag in ((False, "gather"), (True, "overlap")):
        case(f"prefill-{tag}-causal-not-bool", pre(overlapped=ov, causal=1), pre(overlapped=ov),
             "causal must be a bool")
        case(f"prefill-{tag}-q-last-dim-stride", pre(q=x(1, S, Hq, 2 * D)[..., ::2], overlapped=ov),
             pre(overlapped=ov), "q must have a contiguous last dimension")
        case(f"prefill-{tag}-head-dim-unlike-q", pre(k=x(1, S, Hkv, 2 * D), overlapped=ov),
             pre(overlapped=ov), f"D={D}")
    case("prefill-dtype-unlike-k", pre(q=x(1, S, Hq, D, dtype=torch.float16)), pre(),
         "share one dtype")
    case("prefill-dtype-unlike-peers",
         pre(q=x(1, S, Hq, D, dtype=torch.float64), k=x(1, S, Hkv, D, dtype=torch.float64)),
         pre(), "dtype must be the same on every rank")
    case("prefill-zigzag-not-bool", pre(zigzag="yes"), pre(), "zigzag must be a bool")
    case("prefill-sm-scale-unlike-peers", pre(sm_scale=2.0), pre(),
         "sm_scale must be the same on every rank")
    case("prefill-global-seqlen-float", pre(global_seqlen=float(S * W)), pre(),
         "global_seqlen must be None or a positive int")
    case("prefill-overlap-transport-unknown", pre(overlapped=True, transport="nvlink"),
         pre(overlapped=True), "transport must be one of")
    if interpreting():  # the kernels take head dims 64/128/256 only: the API's own refusal
        case("prefill-triton-head-dim-16", pre(impl="triton"),
             pre(q=x(1, S, Hq, 64), k=x(1, S, Hkv, 64), impl="triton"),
             "head dim (q.shape[-1]) must be one of")

    # ---- varlen prefill (two sequences of 2 local tokens each: zig-zag's two chunks)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32, device=device)

    def var(q=None, k=None, cu_q=None, cu_k=None, **extra):
        q = x(4, Hq, D) if q is None else q
        k = x(4, Hkv, D) if k is None else k
        return lambda group: sp.prefill_varlen(q, k, torch.randn_like(k),
                                               cu if cu_q is None else cu_q,
                                               cu if cu_k is None else cu_k, group=group,
                                               **{**kw_ref, **extra})
    case("varlen-cu-seqlens-list", var(cu_q=[0, 2, 4]), var(),
         "cu_seqlens_q must be a 1-D int32 tensor", "got list")
    case("varlen-head-dim-unlike-q", var(k=x(4, Hkv, 2 * D)), var(), f"D={D}")
    case("varlen-q-last-dim-stride", var(q=x(4, Hq, 2 * D)[..., ::2]), var(),
         "q must have a contiguous last dimension")
    case("varlen-causal-not-bool", var(causal="no"), var(), "causal must be a bool")
    case("varlen-sm-scale-unlike-peers", var(sm_scale=2.0), var(),
         "sm_scale must be the same on every rank")
    past_end = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    case("varlen-cu-seqlens-past-the-end", var(cu_k=past_end), var(),
         "cu_seqlens_k[-1] must equal the number of packed tokens")
    case("varlen-max-seqlen-short", var(max_seqlen_q=1, max_seqlen_k=2 * W), var(),
         "max_seqlen_q=1 is shorter than the longest global sequence")
    case("varlen-max-seqlen-float", var(max_seqlen_q=2.0 * W, max_seqlen_k=2 * W), var(),
         "max_seqlen_q must be a non-negative int")

    def short_group():
        """A group whose collectives give up after BAD_INPUT_TIMEOUT_S, connected."""
        dist.barrier()  # the main group waits long: a peer that timed out in a case joins it
        group = dist.new_group(list(range(W)), timeout=timedelta(seconds=BAD_INPUT_TIMEOUT_S))
        dist.all_reduce(torch.ones(1, device=device), group=group)
        return group

    # gloo: a fresh group per case (cheap), so a case that leaves a collective unmatched
    # fails alone, by name, and the next starts clean; NCCL: one (a communicator each
    # would cost seconds and memory)
    shared = short_group() if torch.device(device).type == "cuda" else None
    for i, (name, bad_fn, good_fn, needles) in enumerate(cases):
        bad_rank = i % W
        fn = bad_fn if rank == bad_rank else good_fn
        group = shared or short_group()
        _run_check(res, f"bad-one-rank-{name}", lambda: expect_shard_error(
            lambda: fn(group), f"rank {bad_rank}", *needles))
    return res


def battery_timeout(rank, W):
    """A rank that never joins: the others raise TimeoutError with a message."""
    import wsattn.sp as sp
    res = {}
    if rank == 0:
        _run_check(res, "timeout-missing-peer", lambda: expect_error(
            lambda: sp.prefill(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16),
                               torch.randn(1, 4, 2, 16), timeout_s=2),
            TimeoutError, "never called prefill", "WSATTN_SP_TIMEOUT"))
    else:
        time.sleep(3)
        res["timeout-missing-peer"] = None
    return res


def battery_interpreter(rank, W):
    """The Triton kernels (TRITON_INTERPRET=1, fp16, D=64) under the sp modes."""
    res = {}
    kw = dict(impl="triton", dtype=torch.float16, device="cpu")
    c = 2 * W
    cases = [
        ("triton-gather-B2-S" + str(3 * c) + "-H4-HKV1-zigzag-causal",
         dict(B=2, Sq=3 * c, Sk=3 * c, Hq=4, Hkv=1, D=64, causal=True, zigzag=True, overlapped=False)),
        ("triton-overlap-B1-Sq" + str(2 * c) + "-Sk" + str(5 * c) + "-H4-HKV2-zigzag-causal-prefix",
         dict(B=1, Sq=2 * c, Sk=5 * c, Hq=4, Hkv=2, D=64, causal=True, zigzag=True, overlapped=True)),
        # no prefix: one local call, one call per peer, merge_into (the kernel) in place
        ("triton-overlap-B2-S" + str(3 * c) + "-H4-HKV2-zigzag-causal",
         dict(B=2, Sq=3 * c, Sk=3 * c, Hq=4, Hkv=2, D=64, causal=True, zigzag=True, overlapped=True)),
    ]
    for i, (name, case) in enumerate(cases):
        _run_check(res, name, lambda: check_prefill(rank, W, **case, **kw, seed=300 + i))
    _run_check(res, "triton-varlen-zigzag-causal-prefix", lambda: check_prefill_varlen(
        rank, W, lq=[c, 2 * c], lk=[3 * c, 2 * c], Hq=4, Hkv=2, D=64, causal=True, zigzag=True,
        **kw, seed=310))
    return res


def battery_interpreter_decode(rank, W):
    """The Triton decode kernel under sp.decode."""
    res = {}
    kw = dict(impl="triton", dtype=torch.float16, device="cpu")
    _run_check(res, "triton-decode-B3-H4-HKV2-empty-shards", lambda: check_decode(
        rank, W, lens=[21, 1, 9], Hq=4, Hkv=2, D=64, page=16, seed=320, **kw) and None)
    _run_check(res, "triton-decode-contiguous-exact-size-rank-without-keys",
               lambda: _decode_no_key_rank(rank, W, Hq=4, Hkv=2, D=64, seed=321, **kw))
    return res


def battery_invariance(rank, W, gpu=False):
    """invariant_decode on the whole group and on subgroups of every smaller power-of-two
    size (created inside the group, so one spawn gives W = 1, 2, ..., W): the outputs,
    returned per (impl, size), must be bitwise equal (the parent compares them)."""
    if gpu:
        cases = [("auto", torch.bfloat16, dict(lens=(70000, 1, 4096, 333), block_tokens=4096,
                                                n_blocks=18, Hq=32, Hkv=8, D=128, page=64))]
        device = f"cuda:{rank}"
    else:
        cases = [("reference", torch.float32, {}),
                 ("triton", torch.float16, dict(lens=(40, 1, 17), block_tokens=16, n_blocks=4))]
        device = "cpu"
    sizes = [s for s in (1, 2, 4, 8) if s <= W and W % s == 0]
    mine = {}
    for s in sizes:
        for start in range(0, W, s):  # every rank creates every subgroup, in one order
            g = dist.new_group(list(range(start, start + s))) if s < W else dist.group.WORLD
            if start <= rank < start + s:
                mine[s] = g
    res = {}
    for impl, dtype, extra in cases:
        if impl == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        for s in sizes:
            _run_check(res, f"invariant-{impl}-W{s}", lambda: invariant_output(
                dist.get_rank(mine[s]), s, impl=impl, dtype=dtype, device=device, group=mine[s],
                **extra))
    return res


def battery_two_ranks(rank, W):
    """Everything two CPU ranks check: the reference battery, the Triton kernels through
    the interpreter, invariance against W=1, and last (it breaks the group) a timeout."""
    res = battery_main(rank, W)
    res.update(battery_interpreter(rank, W))
    res.update(battery_interpreter_decode(rank, W))
    res.update(battery_invariance(rank, W))
    res.update(battery_timeout(rank, W))
    return res


def battery_nccl(rank, W):
    """The GPU battery: realistic sizes, bf16, the library's best kernels, NCCL."""
    res = {}
    dev = f"cuda:{rank}"
    kw = dict(impl="auto", dtype=torch.bfloat16, device=dev)
    c = 2 * W
    for i, (name, case) in enumerate([
        ("nccl-gather-B2-S4096-H32-HKV8-D128-zigzag-causal",
         dict(B=2, Sq=4096, Sk=4096, causal=True, zigzag=True, overlapped=False)),
        ("nccl-overlap-B1-S8192-H32-HKV8-D128-zigzag-causal",
         dict(B=1, Sq=8192, Sk=8192, causal=True, zigzag=True, overlapped=True)),
        ("nccl-overlap-B1-Sq2048-Sk6144-H32-HKV8-D128-zigzag-causal-prefix",
         dict(B=1, Sq=2048, Sk=6144, causal=True, zigzag=True, overlapped=True)),
        ("nccl-overlap-symm-B2-S8192-H32-HKV8-D128-zigzag-causal",
         dict(B=2, Sq=8192, Sk=8192, causal=True, zigzag=True, overlapped=True, transport="symm")),
        ("nccl-overlap-symm-B1-Sq2048-Sk6144-H32-HKV8-D128-contiguous-causal-prefix",
         dict(B=1, Sq=2048, Sk=6144, causal=True, zigzag=False, overlapped=True, transport="symm")),
        ("nccl-gather-B1-S" + str(300 * W) + "-H32-HKV8-D128-contiguous-causal",
         dict(B=1, Sq=300 * W, Sk=300 * W, causal=True, zigzag=False, overlapped=False)),
    ]):
        _run_check(res, name, lambda: check_prefill(rank, W, Hq=32, Hkv=8, D=128, **case, **kw,
                                                    seed=400 + i))
    _run_check(res, "nccl-varlen-zigzag-causal-prefix", lambda: check_prefill_varlen(
        rank, W, lq=[512 * c, 17 * c, 100 * c], lk=[512 * c, 300 * c, 100 * c], Hq=32, Hkv=8,
        D=128, causal=True, zigzag=True, give_max=True, seed=410, **kw))
    for ex in ("allgather", "symm"):
        _run_check(res, f"nccl-decode-{ex}-B16-H32-HKV8-D128-empty-shards", lambda: check_decode(
            rank, W, lens=[1, 5000, 70000, 3] + [4096] * 12, Hq=32, Hkv=8, D=128, page=64,
            seed=420, exchange=ex, **kw) and None)
    _run_check(res, "nccl-decode-contiguous-exact-size-rank-without-keys",
               lambda: _decode_no_key_rank(rank, W, Hq=32, Hkv=8, D=128, seed=421, **kw))
    _run_check(res, "nccl-exchange-symm-equals-allgather-bitwise-500-steps",
               lambda: check_exchange_steps(rank, W, steps=500))
    _run_check(res, "nccl-symm-pull-buffers-shared-by-capacity",
               lambda: check_symm_pull_capacity(rank, W))
    _run_check(res, "nccl-cuda-graph-prefill-and-decode", lambda: check_cuda_graph(rank, W))
    res.update(battery_invariance(rank, W, gpu=True))
    res.update(battery_bad_input_nccl(rank, W))
    return res


def check_symm_pull_capacity(rank, W):
    """SymmPull keeps one power-of-two buffer set per (group, dtype, device) and grows it
    only for a shard that does not fit: shards of many lengths cost less than twice the
    largest; every pull, from a smaller view of a larger set too, brings the peer's bits."""
    from wsattn.sp.overlap import SymmPull
    dev = torch.device("cuda", rank)
    group = torch.distributed.group.WORLD
    dtype = torch.float16  # a dtype no other check of the battery pulls: a fresh cache key
    for i, S in enumerate([3000, 5000, 1000, 4999, 20000, 7]):
        shape = (2, 1, S, 2, 64)
        mark = lambda r: (torch.arange(math.prod(shape), device=dev) % 997  # noqa: E731
                          + 1000 * r + 7 * i).to(dtype).view(shape)
        for src, buf, waits in SymmPull.get(group, shape, dtype, dev).post(mark(rank)):
            for w in waits:
                w.wait()
            assert torch.equal(buf, mark(src)), f"S={S}: rank {src}'s shard differs"
    # 2*3000*128 -> 2**20; 5000 -> 2**21 (grown); 1000, 4999 fit; 20000 -> 2**23 (grown)
    assert SymmPull.held(group, dtype, dev) == [2 ** 20, 2 ** 21, 2 ** 23], \
        SymmPull.held(group, dtype, dev)


def check_exchange_steps(rank, W, steps):
    """The fused symmetric-memory exchange over many back-to-back steps (both parities,
    the epoch counters, one rank running ahead of the other) gives, on every step, the
    bits of merge_states over all ranks' parts (which every rank can form: the parts are
    drawn from one seed per step), and the all-gather exchange gives the same bits."""
    import wsattn
    from wsattn.sp.decode import StateExchange
    dev = torch.device("cuda", rank)
    B, Hq, D = 16, 32, 128
    ex = StateExchange.get(torch.distributed.group.WORLD, (B, Hq, D + 1), dev, "symm")
    ag = StateExchange.get(torch.distributed.group.WORLD, (B, Hq, D + 1), dev, "allgather")
    bad = []
    for step in range(steps):
        g = torch.Generator(device=dev).manual_seed(1000 + step)
        outs = torch.randn(W, B, Hq, D, generator=g, device=dev)
        lses = torch.randn(W, B, Hq, generator=g, device=dev) * 3
        lens = torch.randint(0, 2, (W, B), generator=g, device=dev, dtype=torch.int32)
        lses = torch.where(lens[:, :, None] == 0, float("-inf"), lses)
        got, got_lse = ex.merge(outs[rank], lses[rank], lens[rank])
        want, want_lse = wsattn.merge_states(outs, lses, impl="triton")
        if step % 50 == 0:
            o2, l2 = ag.merge(outs[rank], lses[rank], lens[rank])
            if not (torch.equal(o2, want) and torch.equal(l2, want_lse)):
                bad.append(f"allgather differs at step {step}")
        if not (torch.equal(got, want) and torch.equal(got_lse, want_lse)):
            bad.append(f"step {step}: max |diff| {(got - want).abs().max().item():.3g}")
    assert not bad, "; ".join(bad[:5]) + f" ({len(bad)} bad of {steps})"


def check_cuda_graph(rank, W):
    """sp.prefill and sp.decode (check=False) capture in a CUDA graph (no host sync) and
    the replay, on fresh inputs copied into the static ones, equals eager calls."""
    import wsattn.sp as sp
    from wsattn.sp.sharding import shard_kv_cache
    dev = torch.device("cuda", rank)
    g = _gen(500)
    q, k, v = (_rand(g, 1, 1024, h, 128, dtype=torch.bfloat16, device=dev) for h in (32, 8, 8))
    qd = _rand(g, 4, 32, 128, dtype=torch.bfloat16, device=dev)
    kc = _rand(g, 4, 3000, 8, 128, dtype=torch.bfloat16, device=dev)
    kp, vp, table, local = shard_kv_cache(kc, kc, [3000, 1, 700, 2048], W, rank, 64)
    lq, lk = [256 * W, 64 * W], [512 * W, 64 * W]  # local shards of two sequences
    qv = _rand(g, sum(lq) // W, 32, 128, dtype=torch.bfloat16, device=dev)
    kv = _rand(g, sum(lk) // W, 8, 128, dtype=torch.bfloat16, device=dev)
    cu_q = torch.tensor([0, lq[0] // W, sum(lq) // W], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, lk[0] // W, sum(lk) // W], dtype=torch.int32, device=dev)

    def step():
        out, _ = sp.prefill(q, k, v, True, check=False)
        dec = sp.decode(qd, kp, vp, local, table, check=False)
        var, _ = sp.prefill_varlen(qv, kv, kv, cu_q, cu_k, max(lq), max(lk), True, check=False)
        return out, dec, var

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile, allocate the exchange buffers
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for t in (q, qd, qv):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(static, eager):
        _cmp(a, b, torch.bfloat16, "graph replay vs eager")


def battery_bad_input_nccl(rank, W):
    import wsattn.sp as sp
    res = {}
    dev = torch.device("cuda", rank)
    other = "cpu" if rank == W - 1 else dev
    _run_check(res, "nccl-bad-device-one-rank", lambda: expect_error(
        lambda: sp.prefill(torch.randn(1, 4, 2, 64, device=other), torch.randn(1, 4, 2, 64, device=dev),
                           torch.randn(1, 4, 2, 64, device=dev)),
        sp.ShardError, f"rank {W - 1}", "NCCL"))
    res.update({f"nccl-{name}": v for name, v in _bad_input_one_rank(rank, W, dev).items()})
    return res


BATTERIES = {
    "main": battery_main, "two_ranks": battery_two_ranks, "three_ranks": battery_three_ranks, "invariance": battery_invariance,
    "timeout": battery_timeout, "nccl": battery_nccl,
}
