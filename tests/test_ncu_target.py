"""The Nsight Compute target's argument handling (CPU; the profiled call itself needs a
GPU and runs on the device through `scripts/device.sh ncu`)."""

import pytest

from wsattn.bench import chunked, ncu_target


def test_chunked_columns_map_to_the_bench_case():
    """chunked:COLUMN builds the chunked bench's own case: paged at --page for the paged
    and gathered columns, contiguous keys for the -contiguous ones, the bench's id."""
    paged = ncu_target.chunked_case("gluon-paged", 64, 0, 64, chunked.BATCH, chunked.CHUNK)
    assert paged.page == 64 and paged.id == "chunked-B8-C2048-P0-H32-HKV8-D64-page64-bf16"
    flat = ncu_target.chunked_case("gluon-contiguous", 64, 0, 64, chunked.BATCH, chunked.CHUNK)
    assert flat.page is None and flat.shape == paged.shape  # one comparison's two sides
    gathered = ncu_target.chunked_case("wsattn", 128, 2048, 16, 2, 512)
    assert (gathered.page, gathered.D, gathered.prefix, gathered.B, gathered.chunk) == \
        (16, 128, 2048, 2, 512)


def test_unknown_targets_are_refused_before_any_gpu_work():
    with pytest.raises(ValueError, match="chunked column must be one of"):
        ncu_target.main(["chunked:gluon-pagd"])
    with pytest.raises(SystemExit):
        ncu_target.main(["flash"])
