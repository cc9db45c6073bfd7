"""Sequence parallelism on GPUs with NCCL: the gloo batteries' equalities at realistic
sizes (bf16, Hq 32 / Hkv 8 / D 128, the library's best kernels), both state exchanges
(NCCL all-gather and the symmetric-memory one-shot write), invariance on 1, 2, ... W
GPUs, and bad input. One group over every visible GPU."""

import pytest
import torch

from test_sp_common import failures, run_group
from test_sp_gloo import _bitwise_equal_across_sizes

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.gpu
@pytest.mark.multi_gpu
def test_nccl_every_mode_matches_reference():
    world = min(torch.cuda.device_count(), 8)
    results = run_group("nccl", world, env=SAFE_ENV, backend="nccl", timeout_s=540)
    bad = failures(results)
    assert not bad, "\n".join(bad)
    _bitwise_equal_across_sizes(results, impls=("auto",))
