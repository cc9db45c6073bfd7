"""`wsattn generate`: decode random prompts with a local checkpoint and time it.

    wsattn generate --model PATH --batch B --prompt-len N --new-tokens M
                    [--dtype bf16|fp16|fp32] [--device cuda|cpu] [--impl auto|reference|kernels]
                    [--seed S] [--json PATH]

PATH is a local Hugging Face folder (config.json + *.safetensors; nothing is
downloaded). Prompts are random token ids from a generator seeded with --seed (no
tokenizer is needed), decoded greedily. Prefill (the prompts and the first new token)
and decode (each later token) are timed apart, with CUDA events on a GPU and
perf_counter on the CPU, and printed as tokens/s and ms/token; --json writes them as one
row with the environment stamp. Exit status: 0, or 2 when PATH is not a model folder or
the model or the request cannot be run (the message says why).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    from .generate import IMPLS

    p = subparsers.add_parser(
        "generate", help="decode random prompts with a local checkpoint; print tokens/s",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="PATH",
                   help="local checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--batch", type=int, default=1, metavar="B", help="sequences (default 1)")
    p.add_argument("--prompt-len", type=int, default=128, metavar="N",
                   help="prompt tokens per sequence (default 128)")
    p.add_argument("--new-tokens", type=int, default=32, metavar="M",
                   help="new tokens per sequence (default 32)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="model dtype (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--impl", choices=IMPLS, default="auto",
                   help="step function: reference (plain PyTorch), kernels (the GPU runner), "
                        "auto (kernels on CUDA when built, else reference)")
    p.add_argument("--page-size", type=int, default=16, help="KV page size (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--json", metavar="PATH", help="write the timing row there as JSON")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"wsattn generate: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    import torch

    from .generate import Engine, _resolve_impl

    path = args.model
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        return _fail(f"--model {path!r} is not a model folder (expected a local folder with "
                     "config.json and *.safetensors)")
    for name in ("batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda asked for, but torch sees no CUDA GPU")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    try:
        step = _resolve_impl(args.impl, device, dtype)
        engine = Engine(path, dtype=dtype, device=device, step=step, page_size=args.page_size)
    except (ValueError, TypeError, OSError) as e:
        return _fail(f"cannot load {path!r}: {e}")
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, engine.cfg.vocab, (args.batch, args.prompt_len), generator=gen)
    timings: dict = {}
    try:
        engine.run(prompts, args.new_tokens, timings=timings)
    except ValueError as e:
        return _fail(str(e))

    B, N, M = args.batch, args.prompt_len, args.new_tokens
    steps = timings["decode_steps"]
    row = {
        "model": os.path.abspath(path), "family": engine.cfg.family, "batch": B,
        "prompt_len": N, "new_tokens": M, "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device), "step": engine.step_name, "seed": args.seed,
        "prefill_ms": timings["prefill_s"] * 1e3,
        "prefill_tokens_per_s": B * N / timings["prefill_s"],
        "decode_steps": steps,
        "decode_ms_per_token": timings["decode_s"] * 1e3 / steps if steps else None,
        "decode_tokens_per_s": B * steps / timings["decode_s"] if steps else None,
    }
    print(f"{engine.cfg.family} {row['dtype']} on {row['device']} ({row['step']} step), "
          f"batch {B}, prompt {N}, {M} new tokens")
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
