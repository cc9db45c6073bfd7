"""Adapters that let other libraries call wsattn.

* :mod:`wsattn.integrations.transformers` - the ``"wsattn"`` attention implementation for
  Hugging Face transformers (``import wsattn.integrations.transformers``, then
  ``attn_implementation="wsattn"``).

Nothing is imported here, so ``import wsattn`` never needs an optional dependency.
"""
