"""`wsattn generate`: decode prompts with a local checkpoint and time it.

    wsattn generate --model PATH --batch B --prompt-len N --new-tokens M
                    [--prompt TEXT ...] [--temperature T] [--top-k K] [--top-p P]
                    [--dtype bf16|fp16|fp32] [--device cuda|cpu] [--impl auto|reference|kernels]
                    [--seed S] [--json PATH]

PATH is a local Hugging Face folder (config.json + *.safetensors; nothing is
downloaded). Prompts are random token ids from a generator seeded with --seed (no
tokenizer is needed), B of N tokens each; or, with --prompt (once per sequence), the
texts encoded by the folder's own tokenizer, generation stopping at its end-of-sequence
ids (the tokenizer's and those of generation_config.json), and each continuation printed
decoded. Greedy unless --temperature > 0 (then
--top-k / --top-p filter, seeded by --seed). Prefill (the prompts and the first new
token) and decode (each later token) are timed apart, with CUDA events on a GPU and
perf_counter on the CPU, and printed as tokens/s and ms/token; --json writes them as one
row with the environment stamp. Exit status: 0, or 2 when PATH is not a model folder,
has no tokenizer for --prompt, or the model or the request cannot be run (the message
says why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .kv_cache import PAGE_SIZE

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from .generate import IMPLS

    p = subparsers.add_parser(
        "generate", help="decode random prompts with a local checkpoint; print tokens/s",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="PATH",
                   help="local checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="sequences of random ids (default 1; with --prompt, one a prompt)")
    p.add_argument("--prompt-len", type=int, default=None, metavar="N",
                   help="random prompt tokens per sequence (default 128)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="M",
                   help="new tokens per sequence (default 32)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt as text, encoded with PATH's tokenizer (repeat for a batch)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="model dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="step function: reference (plain PyTorch), kernels (the GPU runner), "
                        "auto (kernels on CUDA when built, else reference)")
    p.add_argument("--page-size", type=int, default=PAGE_SIZE,
                   help=f"KV page size in tokens (default {PAGE_SIZE})")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompts and of sampling (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the timing row there as JSON")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"wsattn generate: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    import torch

    from ..models.weights import read_config
    from .generate import (BUCKETS, Engine, _check_batch, _check_device, _check_request,
                           _resolve_impl)

    path = args.model
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return _fail(f"--model {path!r} is not a model folder (expected a local folder with "
                     "config.json and *.safetensors)")
    texts = args.prompt
    if texts is not None and args.batch is not None and args.batch != len(texts):
        return _fail(f"--batch {args.batch} with {len(texts)} --prompt texts: give one or the "
                     "other (with --prompt each text is one sequence)")
    if texts is not None and args.prompt_len is not None:
        return _fail("--prompt-len sizes random prompts; with --prompt the texts set the "
                     "lengths: give one or the other")
    batch = len(texts) if texts is not None else (1 if args.batch is None else args.batch)
    prompt_len = 128 if args.prompt_len is None else args.prompt_len
    for name, value in (("batch", batch), ("prompt-len", prompt_len),
                        ("new-tokens", args.new_tokens)):
        if value < 1:
            return _fail(f"--{name} must be >= 1, got {value}")
    try:
        device = _check_device(args.device)
    except ValueError as e:
        return _fail(f"--device: {e}")
    if args.json:  # before the work, not after it
        where = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(where) \
                or not os.access(where, os.W_OK):
            return _fail(f"--json {args.json!r}: not a file that can be written here "
                         f"({'a folder' if os.path.isdir(args.json) else where + ' is not a writable folder'})")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    tokenizer, eos = None, None
    if texts is not None:  # before the model loads: a missing tokenizer fails at once
        try:
            tokenizer, prompts, eos = _encode(path, texts)
        except (ValueError, OSError) as e:
            return _fail(str(e))
    try:  # the request against the config, before any weight is read or moved
        cfg = read_config(path)
        if tokenizer is None:
            gen = torch.Generator().manual_seed(args.seed)
            prompts = torch.randint(0, cfg.vocab, (batch, prompt_len), generator=gen)
        checked, _, _ = _check_request(cfg, prompts, args.temperature, args.top_k, args.top_p,
                                       eos, False, args.seed)
        _check_batch(checked, args.new_tokens, BUCKETS[-1], cfg.max_positions,
                     cfg.max_positions)
    except (ValueError, TypeError, OSError) as e:
        return _fail(str(e))
    try:
        engine = Engine(path, dtype=dtype, device=device,
                        step=_resolve_impl(args.impl, device, dtype), page_size=args.page_size)
    except (ValueError, TypeError, OSError) as e:
        return _fail(f"cannot load {path!r}: {e}")
    # "auto" follows the checkpoint's dtype once it is known (an fp32 folder on CUDA runs
    # the reference step); the step is built at the first request
    engine.step_name = _resolve_impl(args.impl, engine.device, engine.dtype)
    timings: dict = {}
    try:
        out = engine.run(prompts, args.new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                         seed=args.seed, timings=timings)
    except ValueError as e:
        return _fail(str(e))

    B, M = batch, args.new_tokens
    lengths = [int(p.numel()) for p in prompts]
    N = lengths[0] if len(set(lengths)) == 1 else lengths
    steps = timings["decode_steps"]
    row = {
        "model": os.path.abspath(path), "family": engine.cfg.family, "batch": B,
        "prompt_len": N, "new_tokens": M, "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device), "step": engine.step_name, "seed": args.seed,
        "prompts": "text" if texts is not None else "random ids",
        "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "prefill_ms": timings["prefill_s"] * 1e3,
        "prefill_tokens_per_s": sum(lengths) / timings["prefill_s"],
        "decode_steps": steps,
        "decode_ms_per_token": timings["decode_s"] * 1e3 / steps if steps else None,
        "decode_tokens_per_s": B * steps / timings["decode_s"] if steps else None,
    }
    print(f"{engine.cfg.family} {row['dtype']} on {row['device']} ({row['step']} step), "
          f"batch {B}, prompt {N}, {M} new tokens")
    if tokenizer is not None:
        completions = []
        for b, (p, seq) in enumerate(zip(prompts, out)):
            new = seq[p.numel():].tolist()
            if eos is not None:  # a finished row repeats eos as padding
                ends = [i for i, t in enumerate(new) if t in eos]
                new = new[:ends[0]] if ends else new
            completions.append(tokenizer.decode(new, skip_special_tokens=True))
            print(f"[{b}] {texts[b]}{completions[-1]}")
        row["completions"] = completions
    print(f"prefill: {row['prefill_ms']:.2f} ms, {row['prefill_tokens_per_s']:.1f} tokens/s")
    if steps:
        print(f"decode:  {row['decode_ms_per_token']:.3f} ms/token, "
              f"{row['decode_tokens_per_s']:.1f} tokens/s ({steps} steps of batch {B})")
    if args.json:
        from ..bench.env import stamp

        row = {**stamp(engine.device if engine.device.type == "cuda" else None), **row}
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _encode(path: str, texts):
    """(tokenizer, prompts as int64 tensors, eos ids or None) from PATH's own tokenizer
    (local files only). ValueError naming what is missing."""
    import torch
    need = (f"--prompt needs a tokenizer in {path!r} (one of {', '.join(TOKENIZER_FILES)}, "
            "read by transformers' AutoTokenizer)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        # (AutoTokenizer may build an empty tokenizer from config.json alone)
        raise ValueError(f"{need}, none there; use --prompt-len for random token ids")
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ImportError, OSError, ValueError) as e:
        raise ValueError(f"{need}, which did not load ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    prompts = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if not ids:
            raise ValueError(f"--prompt {i + 1} ({text!r}) encodes to no tokens")
        prompts.append(torch.tensor(ids, dtype=torch.int64))
    return tokenizer, prompts, _stop_ids(path, tokenizer.eos_token_id)


def _stop_ids(path: str, tokenizer_eos):
    """The ids that end a --prompt sequence: the tokenizer's end-of-sequence token and the
    eos_token_id of the folder's generation_config.json (what transformers' generate
    stops at; instruct checkpoints list their end-of-turn ids there), or of config.json
    where there is no generation config. None when neither names one."""
    def ids(value):
        if value is None:
            return []
        return [value] if isinstance(value, int) else list(value)

    found = ids(tokenizer_eos)
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                found += ids(json.load(f).get("eos_token_id"))
            break
    return list(dict.fromkeys(found)) or None
