"""wsattn bench: ceilings, wsattn kernels and peers measured in one run, as JSON rows.

Modules: ``env`` (the stamp every row carries), ``cases`` (the shapes, FLOP and byte
counts), ``ceilings`` (copy bandwidth, bf16 matmul), ``runners`` (wsattn kernels and
SDPA peers, each checked against the reference before it is timed), ``timing``,
``suite`` (check, then time, every case x runner), ``report`` (rows, ratios,
table, JSON), ``plot``, ``cli`` (the ``wsattn bench`` subcommand),
``smoke`` (a CPU run of the kernels through the Triton interpreter), ``host`` (host time
of one eager call, on the GPU) and ``ncu_target`` (the one launch Nsight Compute profiles).

Nothing here imports triton at package import time, so ``python -m wsattn.bench.smoke``
can still set TRITON_INTERPRET=1 before the kernels are defined.
"""
