"""DeepSpeed's CPU shared-memory all-reduce buffer, which it never removes."""

import os


def deepspeed_shm_buffer_name(rank: int) -> str:
    """The /dev/shm name of rank `rank`'s DeepSpeed shared-memory all-reduce buffer in this job.

    deepspeed 0.19.8: ops/csrc/cpu/comm/shm.cpp (`shm_initialize`) creates
    `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>` and never unlinks it. If the format
    changes, nothing is removed and every run leaks 69 MB of tmpfs per rank again
    (tests/launch/test_launchers.py's check).
    """
    return (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    )
