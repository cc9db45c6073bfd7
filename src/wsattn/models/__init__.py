"""Real model families for the decode step: configuration, weights, FlashNorm folding and
a plain-PyTorch reference forward.

* :class:`ModelConfig` (``config.py``): the shape of a Llama 3.x, Qwen2/2.5, Qwen3 dense,
  Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE or dots1 model, from a transformers config or a
  ``config.json`` dict;
  anything else is refused at construction with the feature named.
* ``moe.py``: the reference routing and MoE block, as transformers computes them.
* :func:`load` (``weights.py``): a transformers model object or a local checkpoint
  folder (``config.json`` + ``*.safetensors``) -> ``(ModelConfig, Weights)``, validated
  before any tensor is read; the layout is documented in ``weights.py``.
  :func:`read_config`: the config alone, to check a request before any weight moves.
* :func:`fold` (``flashnorm.py``): RMSNorm weights folded into the following projections.
* ``reference.py``: ``prefill`` / ``decode_step`` with a contiguous or paged
  :class:`KVCache`, in any dtype (float64 in the tests).

``safetensors`` is needed only to read a folder (``pip install 'wsattn[models]'``);
transformers is never imported here.
"""

from .config import ModelConfig, RopeConfig, UnsupportedModelError
from .flashnorm import fold
from .reference import KVCache, decode_step, prefill
from .weights import LayerWeights, Weights, load, read_config

__all__ = ["ModelConfig", "RopeConfig", "UnsupportedModelError", "Weights", "LayerWeights",
           "load", "read_config", "fold", "KVCache", "prefill", "decode_step"]
