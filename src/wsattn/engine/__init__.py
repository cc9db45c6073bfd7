"""The decode engine: a paged KV cache with its allocator (:mod:`.kv_cache`), the step
function that runs one forward over it, and :func:`generate` (:mod:`.generate`).

Nothing heavy is imported here, so ``import wsattn`` stays light; import the submodules.
"""
