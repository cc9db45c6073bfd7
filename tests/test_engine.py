"""The engine: the paged KV allocator, generate() against transformers, sampling, bad
input, and the `wsattn generate` command line (CPU, fp32, tiny random models)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from wsattn.engine.kv_cache import PagedKVCache
from wsattn.models.config import ModelConfig

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=256, vocab_size=256,
            max_position_embeddings=512)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is 10-50x faster than oversubscribing 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(**over):
    return ModelConfig.from_hf({**TINY, **over})


# --------------------------------------------------------------------------- allocator

def test_cache_layout():
    cache = PagedKVCache(_cfg(), num_pages=10, page_size=4, dtype=torch.float32, device="cpu")
    assert cache.k.shape == (2, 10, 4, 1, 64) and cache.v.shape == cache.k.shape
    assert cache.max_seq_len == 40 and cache.max_pages == 10


def test_allocator_pages_freed_and_reused():
    """Released pages go back to the pool and are handed out again, lowest first; no page
    is ever owned by two live sequences."""
    cache = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    a, b = cache.admit([9, 4])                      # 3 pages + 1 page
    assert cache.pages_of(a) == [0, 1, 2] and cache.pages_of(b) == [3]
    assert cache.free_pages == 8
    (c,) = cache.admit([16])                        # 4 pages
    assert cache.pages_of(c) == [4, 5, 6, 7]
    cache.release([a])
    assert cache.free_pages == 7 and cache.live == [b, c]
    (d,) = cache.admit([13])                        # 4 pages: the freed 0,1,2 then 8
    assert cache.pages_of(d) == [0, 1, 2, 8]
    owned = [p for s in cache.live for p in cache.pages_of(s)]
    assert len(owned) == len(set(owned)) == 9 and cache.free_pages == 12 - 9
    cache.release([b, c, d])
    assert cache.free_pages == 12 and cache.live == []
    # the same requests on a fresh pool give the same pages: allocation is deterministic
    again = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu")
    x, y = again.admit([9, 4])
    assert again.pages_of(x) == [0, 1, 2] and again.pages_of(y) == [3]


def test_block_table_and_seqlens():
    cache = PagedKVCache(_cfg(), num_pages=12, page_size=4, dtype=torch.float32, device="cpu",
                         max_seq_len=20)
    assert cache.max_pages == 5
    a, b = cache.admit([9, 4])
    bt = cache.block_table([b, a])
    assert bt.dtype == torch.int32 and bt.tolist() == [[3, 0, 0, 0, 0], [0, 1, 2, 0, 0]]
    assert cache.block_table([a], max_pages=3).tolist() == [[0, 1, 2]]
    with pytest.raises(ValueError, match="max_pages=2"):
        cache.block_table([a], max_pages=2)
    cache.advance([a, b], [7, 4])
    assert cache.seqlens([a, b]).tolist() == [7, 4]
    out = torch.full((2,), -1, dtype=torch.int32)
    assert cache.seqlens([b, a], out=out) is out and out.tolist() == [4, 7]
    with pytest.raises(ValueError, match="capacity of 9"):
        cache.advance([a, b], [3, 0])               # 7 + 3 > 9: nothing advances
    assert cache.seqlens([a, b]).tolist() == [7, 4]


@pytest.mark.parametrize("caps,match", [
    ([41], "more than one sequence may hold"),
    ([20, 20, 4], "not enough free KV pages"),
    ([1, 1, 1, 1, 1], "above the largest batch bucket"),
    ([], "no sequences"),
    ([0], "positive int"),
], ids=["too-long", "no-pages", "batch", "empty", "zero"])
def test_admit_refuses_without_change(caps, match):
    """A request that does not fit raises and leaves the allocator as it was."""
    cache = PagedKVCache(_cfg(), num_pages=10, page_size=4, dtype=torch.float32, device="cpu",
                         max_batch=4)
    with pytest.raises(ValueError, match=match):
        cache.admit(caps)
    assert cache.free_pages == 10 and cache.live == []
    assert cache.admit([40]) == [0]


def test_max_positions_caps_sequences():
    cache = PagedKVCache(_cfg(max_position_embeddings=24), num_pages=10, page_size=4,
                         dtype=torch.float32, device="cpu")
    assert cache.max_seq_len == 24 and cache.max_pages == 6
    with pytest.raises(ValueError, match="more than one sequence may hold"):
        cache.admit([25])


def test_release_unknown_or_repeated():
    cache = PagedKVCache(_cfg(), num_pages=4, page_size=4, dtype=torch.float32, device="cpu")
    (a,) = cache.admit([4])
    with pytest.raises(ValueError, match="not an admitted sequence"):
        cache.release([a + 1])
    with pytest.raises(ValueError, match="repeated"):
        cache.release([a, a])
    assert cache.live == [a]
    cache.release([a])
    with pytest.raises(ValueError, match="not an admitted sequence"):
        cache.release([a])


# --------------------------------------------------------------------------- generate

N_NEW = 32
PROMPT_LENS = (11, 5)


def _hf_model(family, tie=False):
    import transformers

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=256, vocab_size=256,
                  max_position_embeddings=256, tie_word_embeddings=tie)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.Qwen3Config(**common, head_dim=64), transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "sdpa"
    model = cls(cfg).eval()
    with torch.no_grad():  # random norm weights, so a fold that dropped them would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _prompts(seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["llama", "llama-tied", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    """(model object, saved folder, transformers' greedy tokens and logits per prompt)."""
    name = request.param.split("-")[0]
    model = _hf_model(name, tie=request.param.endswith("tied"))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    hf = []
    with torch.no_grad():
        for p in _prompts():
            out = model.generate(p[None], max_new_tokens=N_NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
            hf.append((out.sequences[0], torch.stack(out.logits, 1)[0]))
    return model, str(path), hf


@pytest.mark.parametrize("source", ["folder", "object"])
def test_greedy_matches_transformers(family, source):
    """Batch 2 of different prompt lengths: the tokens of transformers' greedy generate,
    and the logits of every step within fp32 tolerance."""
    from wsattn.engine.generate import generate
    from wsattn.testing import rel_err

    model, path, hf = family
    tokens, logits = generate(model if source == "object" else path, _prompts(), N_NEW,
                              return_logits=True, device="cpu", dtype=torch.float32)
    assert logits.shape == (2, N_NEW, 256) and logits.dtype == torch.float32
    for b, (hf_tokens, hf_logits) in enumerate(hf):
        assert torch.equal(tokens[b], hf_tokens), f"sequence {b}"
        for i in range(N_NEW):
            err = rel_err(logits[b, i], hf_logits[i])
            assert err < 1e-4, f"sequence {b}, step {i}: logits rel err {err:.2e}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from wsattn.engine.generate import Engine

    path = tmp_path_factory.mktemp("engine-llama")
    _hf_model("llama").save_pretrained(path)
    return Engine(str(path), device="cpu", num_pages=16, page_size=8, buckets=(1, 2, 4))


def test_chunked_prefill_matches_whole(engine):
    """Prompts longer than prefill_chunk (several chunks, the last one partial) give the
    same tokens and logits as one prefill call."""
    whole_t, whole_l = engine.run(_prompts(), 6, return_logits=True)
    engine.prefill_chunk = 4
    try:
        part_t, part_l = engine.run(_prompts(), 6, return_logits=True)
    finally:
        engine.prefill_chunk = 512
    assert all(torch.equal(a, b) for a, b in zip(whole_t, part_t))
    assert torch.allclose(whole_l, part_l, rtol=1e-5, atol=1e-5)


def test_tensor_input_and_zero_new_tokens(engine):
    ids = torch.stack([_prompts()[0][:5], _prompts()[1]])
    out = engine.run(ids, 3)
    assert out.shape == (2, 8) and torch.equal(out[:, :5], ids)
    out, logits = engine.run(ids, 0, return_logits=True)
    assert torch.equal(out, ids) and logits.shape == (2, 0, 256)
    assert engine.cache.live == [] and engine.cache.free_pages == 16


def test_decode_loop_builds_no_host_tensor_per_step(engine, monkeypatch):
    """The lengths each decode step attends over are advanced on the device: the cache's
    host lengths become a tensor once per generate call, not once a token (on CUDA that
    host-to-device copy synchronised the stream every step), and the step sees the same
    values as before: the cache length including the new token."""
    calls, seen = [], []
    real_seqlens, real_decode = type(engine.cache).seqlens, engine.step.decode
    monkeypatch.setattr(type(engine.cache), "seqlens",
                        lambda self, *a, **k: calls.append(1) or real_seqlens(self, *a, **k))

    def decode(tokens, seqlens, block_table):
        seen.append(seqlens.tolist())
        return real_decode(tokens, seqlens, block_table)

    monkeypatch.setattr(engine.step, "decode", decode)
    prompts = _prompts()
    engine.run(prompts, 6)
    prefill_calls = len(calls) - 1  # one for the decode loop, the rest inside the prefill
    assert len(seen) == 5
    assert seen == [[p.numel() + i for p in prompts] for i in range(1, 6)]
    calls.clear()
    engine.run(prompts, 12)
    assert len(calls) - 1 == prefill_calls  # 11 decode steps, still one call for the loop


class _FakeEvent:
    """A CUDA event stand-in whose completion the test controls."""
    log = []

    def __init__(self):
        self.ready = False

    def record(self):
        _FakeEvent.log.append(self)

    def query(self):
        return self.ready

    def synchronize(self):
        _FakeEvent.log.append(("waited", self))
        self.ready = True


def test_eos_stop_reads_flags_without_waiting_and_names_the_first_done_step(monkeypatch):
    """The CUDA path of the eos check: each step's flag is read once its event has
    passed (never waited for, unless the host is more than MAX_LAG steps ahead), and
    finish() names the first done step so that the steps run past it can be dropped."""
    from wsattn.engine.generate import _EosStop
    _FakeEvent.log = []
    monkeypatch.setattr(_EosStop, "_slot", staticmethod(lambda: torch.empty((), dtype=torch.bool)))
    monkeypatch.setattr(_EosStop, "_event", staticmethod(_FakeEvent))
    stop = _EosStop("cpu")
    stop.cuda = True  # the event path, with fake events and unpinned slots
    stop.push(torch.tensor(False))
    stop.push(torch.tensor(True))    # step 1: all done, flag not yet on the host
    assert stop.done_at() is None and not any(isinstance(e, tuple) for e in _FakeEvent.log)
    stop.push(torch.tensor(True))    # step 2; 3 pending > MAX_LAG: waits for step 0 only
    assert stop.done_at() is None
    assert [e for e in _FakeEvent.log if isinstance(e, tuple)] == [("waited", _FakeEvent.log[0])]
    _FakeEvent.log[1].ready = True   # step 1's flag arrives
    assert stop.done_at() == 1 and stop.finish() == 1 and stop.pending == []
    stop.push(torch.tensor(True))    # after the stop nothing more is read
    assert stop.finish() == 1

    never = _EosStop("cpu")
    never.cuda = True
    for _ in range(2):
        never.push(torch.tensor(False))
    assert never.done_at() is None and never.finish() is None  # finish waits for all
    cpu = _EosStop("cpu")
    cpu.push(torch.tensor(False))
    cpu.push(torch.tensor(True))
    assert cpu.done_at() == 1  # read at once on the CPU


def test_eos_outputs_do_not_depend_on_when_the_stop_is_seen(engine, monkeypatch):
    """Generation with eos gives the same tokens and logits whether the stop is seen at
    once (CPU) or steps later (the CUDA path's lag, simulated): the steps past the first
    all-done step are dropped."""
    from wsattn.engine import generate as G
    free = engine.run(_prompts(), 12)
    # sequence 0 stops at its 4th new token, sequence 1 at its 6th: all done after step 5
    eos = [int(free[0][PROMPT_LENS[0] + 3]), int(free[1][PROMPT_LENS[1] + 5])]
    now_t, now_l = engine.run(_prompts(), 12, eos_token_id=eos, return_logits=True)
    assert now_l.shape[1] < 12  # the stop happened, so the late run has steps to drop

    class Late(G._EosStop):
        def done_at(self):  # seen three steps late
            first = self.finish()
            return first if first is not None and self.step >= first + 3 else None

    monkeypatch.setattr(G, "_EosStop", Late)
    late_t, late_l = engine.run(_prompts(), 12, eos_token_id=eos, return_logits=True)
    assert [len(t) for t in late_t] == [len(t) for t in now_t]
    assert all(torch.equal(a, b) for a, b in zip(now_t, late_t))
    assert torch.equal(now_l, late_l)


def test_eos_stops_like_transformers(engine):
    """A sequence that emits eos is padded with eos after it; generation stops when all
    sequences are done (transformers' behaviour with pad = eos)."""
    free = engine.run(_prompts(), 12)
    eos = int(free[0][PROMPT_LENS[0] + 3])        # sequence 0's 4th new token
    out = engine.run(_prompts(), 12, eos_token_id=eos)
    for b, (f, o) in enumerate(zip(free, out)):
        gen = f[PROMPT_LENS[b]:]
        hits = (gen == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else len(gen)
        assert torch.equal(o[PROMPT_LENS[b]:PROMPT_LENS[b] + stop], gen[:stop])
        assert torch.all(o[PROMPT_LENS[b] + stop:] == eos)
    assert len(out[0]) - PROMPT_LENS[0] <= 12


def test_sampling_seeded(engine):
    kw = dict(temperature=1.5, top_k=50, top_p=0.95)
    a = engine.run(_prompts(), 16, seed=1, **kw)
    b = engine.run(_prompts(), 16, seed=1, **kw)
    c = engine.run(_prompts(), 16, seed=2, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    greedy = engine.run(_prompts(), 16)
    top1 = engine.run(_prompts(), 16, temperature=1.0, top_k=1, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(greedy, top1))


def test_sample_filters():
    from wsattn.engine.generate import sample

    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, 0.0), torch.ones(2000, dtype=torch.int64))
    assert set(sample(logits, 1.0, top_k=2, generator=g).tolist()) == {1, 2}
    # p(1) ~ 0.47, p(2) ~ 0.43: top_p 0.5 keeps both, 0.4 keeps only the first
    assert set(sample(logits, 1.0, top_p=0.5, generator=g).tolist()) == {1, 2}
    assert set(sample(logits, 1.0, top_p=0.4, generator=g).tolist()) == {1}
    assert set(sample(logits, 1.0, generator=g).tolist()) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("call,match", [
    (lambda e: e.run([torch.tensor([1, 256])], 4), r"input_ids\[0\] holds token id 256"),
    (lambda e: e.run([torch.tensor([3]), torch.tensor([-1, 2])], 4), r"input_ids\[1\] holds token id -1"),
    (lambda e: e.run([torch.tensor([3]), torch.tensor([], dtype=torch.int64)], 4), "empty prompt"),
    (lambda e: e.run(torch.zeros(2, 0, dtype=torch.int64), 4), "empty prompt"),
    (lambda e: e.run([[1.0, 2.0]], 4), "integer token ids"),
    (lambda e: e.run([[1, 2]], -1), "max_new_tokens must be an int >= 0"),
    (lambda e: e.run([[1, 2]] * 5, 4), "above the largest batch bucket"),
    (lambda e: e.run([[1] * 250], 7), "past the 256 positions"),
    (lambda e: e.run([[1] * 60, [2] * 60, [3] * 20], 10), "not enough free KV pages"),
    (lambda e: e.run([[1, 2]], 4, temperature=-1.0), "temperature"),
    (lambda e: e.run([[1, 2]], 4, top_k=0), "top_k"),
    (lambda e: e.run([[1, 2]], 4, top_p=1.5), "top_p"),
    (lambda e: e.run([[1, 2]], 4, eos_token_id=999), "eos_token_id"),
    (lambda e: e.run([[1, 2]], 4, eos_token_id=[1.0]), "eos_token_id"),
    (lambda e: e.run([5, 6, 7], 2), r"input_ids\[0\] must be one prompt, a 1-D sequence .* a single id"),
    (lambda e: e.run([torch.tensor([[5, 6], [7, 8]])], 2), r"input_ids\[0\] .* shape \(2, 2\)"),
    (lambda e: e.run([[1, 2]], 4, temperature=float("inf")), "finite"),
    (lambda e: e.run([[1, 2]], 4, temperature=float("nan")), "finite"),
    (lambda e: e.run([[1, 2]], 4, temperature=1.0, seed=2**64), r"seed .* \[-2\*\*63, 2\*\*64\)"),
    (lambda e: e.run([[1, 2]], 4, temperature=1.0, seed=-2**63 - 1), "seed"),
], ids=["id-too-big", "id-negative", "empty-prompt", "empty-tensor", "float-ids",
        "negative-new", "batch", "max-positions", "pages", "temperature", "top-k", "top-p",
        "eos", "eos-float", "flat-ids", "2d-row", "temperature-inf", "temperature-nan",
        "seed-too-big", "seed-too-small"])
def test_bad_input_raises_before_any_work(engine, monkeypatch, call, match):
    """Each bad request raises ValueError naming the argument before any step runs, and
    leaves the cache unwritten and every page free."""
    def no_work(*a, **k):
        raise AssertionError("a step ran on bad input")

    monkeypatch.setattr(engine.step, "prefill", no_work)
    monkeypatch.setattr(engine.step, "decode", no_work)
    before = engine.cache.k.clone(), engine.cache.v.clone()
    with pytest.raises(ValueError, match=match):
        call(engine)
    assert engine.cache.live == [] and engine.cache.free_pages == 16
    assert torch.equal(engine.cache.k, before[0]) and torch.equal(engine.cache.v, before[1])


def test_eos_ids_integer_like(engine):
    """eos_token_id as numpy ints or 0-d / 1-D integer tensors reads as the same ids."""
    import numpy as np

    from wsattn.engine.generate import _eos

    for value in (np.int64(5), torch.tensor(5), [np.int32(5), torch.tensor(7)],
                  torch.tensor([5, 7]), np.array([5, 7]), np.array(5), (5, 7)):
        assert _eos(value, 256) in ([5], [5, 7]), value
    for value in (torch.tensor(5.0), torch.tensor([[5]]), True, "5", 5.0, []):
        with pytest.raises(ValueError, match="eos_token_id"):
            _eos(value, 256)


def test_tiny_temperature_samples_the_argmax():
    """A temperature small enough to overflow logits / temperature samples the argmax (ties
    shared), not a NaN distribution."""
    from wsattn.engine.generate import sample

    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [1.0, 1.0, 0.0, -5.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    got = sample(logits, 1e-40, generator=g).view(500, 2)
    assert torch.all(got[:, 0] == 1)
    assert set(got[:, 1].tolist()) == {0, 1}


def test_device_named_when_unusable():
    from wsattn.engine.generate import Engine, _check_device

    with pytest.raises(ValueError, match="device must be None, a torch.device .* got 'foo'"):
        _check_device("foo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            _check_device("cuda")
    with pytest.raises(ValueError, match="device must be"):
        Engine(_hf_model("llama"), device="foo")
    assert _check_device("cpu") == torch.device("cpu")


def test_max_seq_len_must_be_an_int():
    from wsattn.engine.generate import Engine

    for bad in (100.9, True, "100"):
        with pytest.raises(ValueError, match="max_seq_len must be None or an int"):
            Engine(_hf_model("llama"), device="cpu", max_seq_len=bad)


def test_pages_released_when_a_step_raises(engine, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("step failed")

    monkeypatch.setattr(engine.step, "decode", broken)
    with pytest.raises(RuntimeError, match="step failed"):
        engine.run(_prompts(), 4)
    assert engine.cache.live == [] and engine.cache.free_pages == 16


def test_generate_checks_before_loading(tmp_path):
    """Arguments that need no model are refused before the checkpoint is opened."""
    from wsattn.engine.generate import generate

    missing = str(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(missing, [[1]], -2)
    with pytest.raises(ValueError, match="impl must be one of"):
        generate(missing, [[1]], 2, impl="fast")
    with pytest.raises(ValueError, match="not a folder with a config.json"):
        generate(missing, [[1]], 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(input_ids=[[1, 256]]), "input_ids\\[0\\] holds token id 256"),
    (dict(input_ids=[[1]] * 3, buckets=(1, 2)), "batch of 3 is above the largest"),
    (dict(input_ids=[[1] * 250], max_new_tokens=7), "past the 256 positions"),
    (dict(eos_token_id=300), "eos_token_id"),
    (dict(seed="x"), "seed"),
    (dict(return_logits=1), "return_logits"),
], ids=["vocab", "bucket", "positions", "eos", "seed", "return-logits"])
def test_generate_checks_the_request_before_any_weight_moves(tmp_path, monkeypatch, kwargs,
                                                             match):
    """A request the config alone refuses (token ids, batch against the buckets, positions,
    eos, seed) is refused before any tensor is read, from a folder or a model object."""
    from wsattn.engine import generate as g
    from wsattn.models import weights

    def no_load(*a, **k):
        raise AssertionError("weights were loaded for a bad request")

    monkeypatch.setattr(weights, "load", no_load)
    model = _hf_model("llama")
    model.save_pretrained(tmp_path)
    call = dict(input_ids=[[1, 2]], max_new_tokens=2, device="cpu") | kwargs
    for source in (str(tmp_path), model):
        with pytest.raises(ValueError, match=match):
            g.generate(source, **call)


def test_cli_checks_the_request_before_loading(tmp_path, capsys, monkeypatch):
    """--batch above the largest bucket and a prompt past the model's positions exit 2
    with the reason before any weight is read."""
    from wsattn.cli import main
    from wsattn.engine.generate import BUCKETS
    from wsattn.models import weights

    def no_load(*a, **k):
        raise AssertionError("weights were loaded for a bad request")

    monkeypatch.setattr(weights, "load", no_load)
    _hf_model("llama").save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--device", "cpu"]
    assert main(base + ["--batch", str(BUCKETS[-1] + 1), "--new-tokens", "2"]) == 2
    assert f"batch of {BUCKETS[-1] + 1} is above the largest" in capsys.readouterr().err
    assert main(base + ["--prompt-len", "250", "--new-tokens", "7"]) == 2
    assert "past the 256 positions" in capsys.readouterr().err


def test_cli_auto_follows_the_checkpoint_dtype(tmp_path, monkeypatch):
    """--impl auto on CUDA picks the kernel step for a 16-bit checkpoint and the reference
    step for an fp32 one, decided again once the folder's dtype is known (the kernel step
    refuses fp32)."""
    from wsattn.cli import main
    from wsattn.engine import generate as g

    seen = []

    class Probe:
        def __init__(self, path, *, dtype, device, step, page_size):
            # what the folder holds: the fp32 weights save_pretrained wrote
            self.device, self.dtype = torch.device(device), dtype or torch.float32
            self.step_name = step

        def __setattr__(self, name, value):
            if name == "step_name":
                seen.append(value)
            object.__setattr__(self, name, value)

        def run(self, *a, **k):
            raise ValueError("probe: stop before any work")

    monkeypatch.setattr(g, "Engine", Probe)
    monkeypatch.setattr(g.torch.cuda, "is_available", lambda: True)
    _hf_model("llama").save_pretrained(tmp_path)
    for dtype, want in ((None, "reference"), ("bf16", "kernels")):
        seen.clear()
        args = ["generate", "--model", str(tmp_path), "--prompt-len", "4", "--new-tokens", "1"]
        assert main(args + (["--dtype", dtype] if dtype else [])) == 2
        assert seen[-1] == want, (dtype, seen)


def test_kernels_step_refused_on_plain_cpu(monkeypatch):
    """step='kernels' on the CPU without the Triton interpreter is refused by name when the
    step is built, before any forward runs or a sequence is admitted, instead of running
    something else under its name; impl='auto' on the CPU picks the reference step."""
    from wsattn.engine.generate import Engine, _resolve_impl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = Engine(_hf_model("llama"), device="cpu", step="kernels")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernels.run(_prompts(), 2)
    assert kernels.cache is None or kernels.cache.live == []
    assert _resolve_impl("auto", "cpu") == "reference"
    assert _resolve_impl("auto", "cuda", torch.bfloat16) == "kernels"
    assert _resolve_impl("auto", "cuda", torch.float32) == "reference"
    assert _resolve_impl("auto", "cuda") == "kernels"  # decided again from the checkpoint


def test_top_level_generate_is_lazy(engine):
    import subprocess
    import sys

    code = ("import sys, wsattn; assert 'wsattn.engine.generate' not in sys.modules; "
            "assert 'generate' in wsattn.__all__ and callable(wsattn.generate)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- CLI

def test_cli_generate(tmp_path):
    import json
    import subprocess
    import sys

    _hf_model("qwen2").save_pretrained(tmp_path / "m")
    out_json = tmp_path / "row.json"
    cmd = [sys.executable, "-m", "wsattn.cli", "generate", "--model", str(tmp_path / "m"),
           "--batch", "2", "--prompt-len", "9", "--new-tokens", "5", "--device", "cpu",
           "--seed", "3", "--json", str(out_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "ms/token" in res.stdout and "tokens/s" in res.stdout
    row = json.loads(out_json.read_text())
    assert row["batch"] == 2 and row["decode_steps"] == 4 and row["family"] == "qwen2"
    assert row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0 and row["step"] == "reference"



def _word_tokenizer(path, eos="<eos>"):
    """A word-level tokenizer saved as the folder's own (tokenizer.json): 65 words, ids
    below the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(60)] + ["the", "cat", "sat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token=eos).save_pretrained(path)


def test_cli_generate_text_prompts(tmp_path, capsys):
    """--prompt (repeated): the texts through the folder's tokenizer, one sequence each, the
    continuations printed decoded and in the JSON row; greedy, the same tokens as the
    engine given the encoded ids; sampling flags reach the engine (seeded: reproducible)."""
    import json

    from transformers import AutoTokenizer

    from wsattn.cli import main
    from wsattn.engine.generate import Engine

    # (a llama folder: transformers reads a qwen2 folder's tokenizer.json with its own BPE
    # class, which this word-level file is not)
    _hf_model("llama").save_pretrained(tmp_path)
    _word_tokenizer(tmp_path, eos=None)  # no eos: every row runs its 6 tokens
    texts = ["the cat sat", "w1 w2 w3 w4 w5 w6 w7"]
    out_json = tmp_path / "row.json"
    argv = ["generate", "--model", str(tmp_path), "--new-tokens", "6", "--device", "cpu",
            "--json", str(out_json)]
    for t in texts:
        argv += ["--prompt", t]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    row = json.loads(out_json.read_text())
    assert row["batch"] == 2 and row["prompt_len"] == [3, 7] and row["prompts"] == "text"
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = [torch.tensor(tok(t)["input_ids"]) for t in texts]
    want = Engine(str(tmp_path), device="cpu", step="reference").run(ids, 6)
    for b, t in enumerate(texts):
        text = tok.decode(want[b][len(ids[b]):].tolist(), skip_special_tokens=True)
        assert row["completions"][b] == text and f"[{b}] {t}{text}" in printed
    # sampling: the flags reach the engine, and a seed repeats the draw
    samples = []
    for _ in range(2):
        assert main(argv + ["--temperature", "0.9", "--top-k", "5", "--top-p", "0.9",
                            "--seed", "7"]) == 0
        samples.append(json.loads(out_json.read_text()))
    assert samples[0]["completions"] == samples[1]["completions"]
    assert samples[0]["temperature"] == 0.9 and samples[0]["top_k"] == 5


def test_cli_text_prompts_refusals(tmp_path, capsys):
    """--prompt without a tokenizer in the folder, with a --batch of another count, or with
    --prompt-len: exit 2 with the reason, before the model loads."""
    from wsattn.cli import main

    _hf_model("llama").save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--new-tokens", "2", "--device", "cpu",
            "--prompt", "the cat"]
    assert main(base) == 2
    assert "--prompt needs a tokenizer" in capsys.readouterr().err
    _word_tokenizer(tmp_path)
    assert main(base + ["--batch", "3"]) == 2
    assert "--batch 3 with 1 --prompt texts" in capsys.readouterr().err
    assert main(base + ["--prompt-len", "5"]) == 2
    assert "--prompt-len sizes random prompts" in capsys.readouterr().err
    assert main(base) == 0


def test_cli_refuses_a_bad_device_or_json_path_before_the_work(tmp_path, capsys, monkeypatch):
    """--device torch cannot parse, and a --json path that cannot be written: exit 2 with
    the reason before any weight is read (not a traceback after the run)."""
    from wsattn.cli import main
    from wsattn.models import weights

    def no_load(*a, **k):
        raise AssertionError("weights were loaded for a bad request")

    monkeypatch.setattr(weights, "load", no_load)
    _hf_model("llama").save_pretrained(tmp_path)
    base = ["generate", "--model", str(tmp_path), "--prompt-len", "4", "--new-tokens", "2"]
    assert main(base + ["--device", "foo"]) == 2
    assert "--device: device must be" in capsys.readouterr().err
    assert main(base + ["--device", "cpu", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "--json" in capsys.readouterr().err
    assert main(base + ["--device", "cpu", "--json", str(tmp_path)]) == 2
    assert "a folder" in capsys.readouterr().err


def test_cli_stops_at_the_generation_configs_eos_ids(tmp_path):
    """--prompt stops at the tokenizer's eos and at the ids generation_config.json lists
    (an instruct checkpoint's end-of-turn ids), or config.json's without one."""
    from wsattn.engine.cli import _stop_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert _stop_ids(str(tmp_path), 2) == [2, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 8]}))
    assert _stop_ids(str(tmp_path), 2) == [2, 7, 8]
    assert _stop_ids(str(tmp_path), None) == [2, 7, 8]
    (tmp_path / "generation_config.json").write_text(json.dumps({}))
    assert _stop_ids(str(tmp_path), None) is None


def test_cli_not_a_model_folder(tmp_path, capsys):
    from wsattn.cli import main

    code = main(["generate", "--model", str(tmp_path), "--batch", "1", "--prompt-len", "4",
                 "--new-tokens", "2", "--device", "cpu"])
    assert code == 2 and "is not a model folder" in capsys.readouterr().err


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_cuda_reference_step_matches_cpu(tmp_path):
    """The reference step on CUDA (fp32) picks the CPU's greedy tokens, and seeded
    sampling with a CUDA generator is reproducible."""
    from wsattn.engine.generate import generate

    _hf_model("qwen3").save_pretrained(tmp_path)
    cpu = generate(str(tmp_path), _prompts(), 16, device="cpu", dtype=torch.float32)
    gpu = generate(str(tmp_path), _prompts(), 16, device="cuda", dtype=torch.float32,
                   impl="reference")
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu))
    kw = dict(device="cuda", dtype=torch.float32, impl="reference", temperature=1.0, top_p=0.9)
    a = generate(str(tmp_path), _prompts(), 16, seed=5, **kw)
    b = generate(str(tmp_path), _prompts(), 16, seed=5, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_moe_models_on_the_reference_step_and_the_kernel_steps_device_check(monkeypatch):
    """The kernel step takes Qwen3-MoE and OLMoE (they get past the feature checks to the
    device check: on the CPU without the interpreter it names TRITON_INTERPRET, not the
    model) and impl="auto" picks it on CUDA for bf16; on the CPU "auto" runs the
    reference step, which gives transformers' greedy tokens."""
    import transformers

    import wsattn
    from wsattn.engine.generate import Engine, _resolve_impl
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=1, num_key_value_heads=1, head_dim=64, num_experts=4,
        num_experts_per_tok=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.tensor([[1, 2, 3]])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    olmoe = transformers.AutoModelForCausalLM.from_config(transformers.OlmoeConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, vocab_size=128)).eval()
    for m in (model, olmoe):
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            Engine(m, step="kernels", device="cpu").run(ids, 2)
    assert _resolve_impl("auto", "cuda", torch.bfloat16) == "kernels"
    out = wsattn.generate(model, ids, 4)
    ref = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, ref)
