"""The kernel decode step on a GPU at the benchmark's real model shapes (bf16, random
weights): teacher-forced logits over 128 steps against transformers, graph replay equal
to eager, and 10,000 graph replays without drift (on a toy model and at the 1B shape).
GPU-only; the CPU twins are in test_runner.py / test_engine.py."""

from __future__ import annotations

import pytest
import torch

from wsattn.bench import step as step_bench
from wsattn.testing import TOL, rel_err

STEPS = 128


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama-3.2-1b", "llama-3.1-8b"])
def test_gpu_teacher_forced_logits_over_128_steps(model):
    """Every one of 128 decode steps: the engine's logits, teacher-forced on its own tokens,
    are within the bf16 tolerance of the same weights computed in fp32, or within twice
    transformers' own bf16 error there (random weights make bf16 logits flat; see
    wsattn.bench.step.teacher_forced_check). Graph and PDL as shipped."""
    hf = step_bench.build_model(model, "cuda", "bf16")
    ref = step_bench.fp32_reference(hf)
    case = step_bench.StepCase(model, 2, 256)
    engine, _ = step_bench.build_engine(hf, case, pdl=True, max_seq_len=256 + STEPS + 2,
                                        device="cuda")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, case.cfg.vocab, (2, 256), generator=g)
    tokens, logits = engine.run(ids, STEPS, return_logits=True)
    S = ids.shape[1]
    worst = []
    for b in range(2):
        seq = tokens[b:b + 1, :S + STEPS - 1].cuda()
        with torch.inference_mode():
            theirs = hf(input_ids=seq, logits_to_keep=STEPS).logits[0].float()
            exact = ref(input_ids=seq, logits_to_keep=STEPS).logits[0].float()
        ours = logits[b].float()
        for t in range(STEPS):
            e_ours, e_hf = rel_err(ours[t], exact[t]), rel_err(theirs[t], exact[t])
            worst.append((e_ours - max(TOL["bf16"], 2 * e_hf), t, b, e_ours, e_hf))
    worst.sort(reverse=True)
    assert worst[0][0] <= 0, f"step {worst[0][1]} seq {worst[0][2]}: ours {worst[0][3]:.3e}, " \
                             f"transformers bf16 {worst[0][4]:.3e} (vs fp32)"


@pytest.mark.gpu
@pytest.mark.parametrize("model, B", [("llama-3.2-1b", 1), ("llama-3.2-1b", 8),
                                      ("llama-3.1-8b", 1)])
def test_gpu_graph_replay_equals_eager_at_model_shapes(model, B):
    """At the benchmark's model shapes (bf16, PDL as shipped, prompts of different lengths
    so prefill is varlen): the captured step's tokens and logits over 64 steps equal the
    eager step's bit for bit."""
    from wsattn.engine.runner import KernelStep

    hf = step_bench.build_model(model, "cuda", "bf16")
    case = step_bench.StepCase(model, B, 256)
    steps = 64
    engine, _ = step_bench.build_engine(hf, case, pdl=True, max_seq_len=256 + steps + 2,
                                        device="cuda")
    del hf
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(0, case.cfg.vocab, (256 - 29 * b,), generator=g) for b in range(B)]
    graph_t, graph_l = engine.run(ps, steps, return_logits=True)
    assert engine.step.graphs  # the default on CUDA: the first run replayed captured steps
    engine.step = KernelStep(engine.cfg, engine.weights, engine.cache, buckets=engine.buckets,
                             graphs=False, pdl=True)
    eager_t, eager_l = engine.run(ps, steps, return_logits=True)
    assert all(torch.equal(a, b) for a, b in zip(graph_t, eager_t))
    assert torch.equal(graph_l, eager_l)


@pytest.mark.gpu
def test_gpu_10000_replayed_steps():
    """10,000 graph replays give the eager step's tokens bit for bit: no drift from stale
    buffers, workspace counters, split-K reductions or the cache's page bookkeeping."""
    from test_runner import _gpu_engine, _gpu_prompts

    steps = 10_000
    ps = [p[:16] for p in _gpu_prompts()[:2]]
    pages = 2 * -(-(16 + steps) // 16) + 2
    graph = _gpu_engine(graphs=True, layers=2, max_pos=16384, num_pages=pages)[0].run(ps, steps)
    eager = _gpu_engine(graphs=False, layers=2, max_pos=16384, num_pages=pages)[0].run(ps, steps)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))


@pytest.mark.gpu
def test_gpu_10000_replayed_steps_at_the_1b_shape():
    """The same at the Llama-3.2-1B shape (bf16, PDL as shipped, two sequences of
    different lengths): 10,000 graph replays give the eager step's tokens bit for bit."""
    from wsattn.engine.runner import KernelStep

    steps = 10_000
    hf = step_bench.build_model("llama-3.2-1b", "cuda", "bf16")
    case = step_bench.StepCase("llama-3.2-1b", 2, 16)
    engine, _ = step_bench.build_engine(hf, case, pdl=True, max_seq_len=16 + steps + 2,
                                        device="cuda")
    del hf
    g = torch.Generator().manual_seed(13)
    ps = [torch.randint(0, case.cfg.vocab, (n,), generator=g) for n in (16, 11)]
    graph = engine.run(ps, steps)
    assert engine.step.graphs
    engine.step = KernelStep(engine.cfg, engine.weights, engine.cache, buckets=engine.buckets,
                             graphs=False, pdl=True)
    eager = engine.run(ps, steps)
    assert all(torch.equal(a, b) for a, b in zip(graph, eager))


@pytest.mark.gpu
def test_gpu_eos_stop_without_per_token_sync_matches_a_synchronous_stop(monkeypatch):
    """With eos on CUDA the all-done flag is read without waiting (the GPU may run steps
    past the stop, which are dropped): tokens and logits equal those of a stop read
    synchronously each step."""
    from test_runner import _gpu_engine, _gpu_prompts

    from wsattn.engine import generate as G

    engine = _gpu_engine(graphs=True, layers=2)[0]
    ps = [p[:16] for p in _gpu_prompts()[:2]]
    free = engine.run(ps, 24)
    n = [p.numel() for p in ps]
    eos = [int(free[0][n[0] + 5]), int(free[1][n[1] + 9])]
    fast_t, fast_l = engine.run(ps, 24, eos_token_id=eos, return_logits=True)

    class Sync(G._EosStop):
        def done_at(self):
            return self.finish()  # waits for every flag: the old per-token sync

    monkeypatch.setattr(G, "_EosStop", Sync)
    sync_t, sync_l = engine.run(ps, 24, eos_token_id=eos, return_logits=True)
    assert sync_l.shape[1] < 24
    assert [len(t) for t in fast_t] == [len(t) for t in sync_t]
    assert all(torch.equal(a, b) for a, b in zip(fast_t, sync_t)) and torch.equal(fast_l, sync_l)
