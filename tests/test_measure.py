"""The measuring tools (`ops/measure.py`): peak memory of a process and of a child process."""

from __future__ import annotations

import pytest
import torch

from pairclean.bench.measure import PeakMemory, high_water_rss_mib


pytestmark = pytest.mark.usefixtures("fresh_notices")


def test_peak_memory_sees_an_allocation():
    with PeakMemory(interval=0.01) as base:
        pass
    with PeakMemory(interval=0.01) as mem:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, alive at the end-of-block sample
        block += 1
    assert mem.peak_rss_mib > base.peak_rss_mib + 48 and mem.peak_mib > base.peak_mib + 48


def test_a_childs_peak_rss_is_its_own_not_the_parents_at_spawn():
    # Linux carries ru_maxrss across fork + exec: a child spawned by a parent holding 256 MiB
    # reports >= 256 MiB there. VmHWM, which the benchmarks read, starts afresh at exec.
    import subprocess
    import sys

    held = torch.ones(256 * 2**20 // 4)
    held += 1
    child = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # the child is running its own program
        with PeakMemory(child.pid, interval=0.01) as mem:
            pass
        assert 0 < high_water_rss_mib(child.pid) < 128 and 0 < mem.high_water_mib < 128
    finally:
        child.kill()
        child.wait()
    assert high_water_rss_mib() > 256  # this process's own peak
    del held
