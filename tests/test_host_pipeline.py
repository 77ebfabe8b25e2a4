"""The input-pipeline model against the published EfficientNet case."""
from __future__ import annotations

import pytest

from memsched import hardware
from memsched.host_pipeline import InputPipeline, check, check_on, cpu_time, grid

GB = 10**9
PUBLISHED = InputPipeline(batch_bytes=0, storage_bw=2 * GB, calls_per_thread=5, accesses=(439, 144, 116),
                          access_bytes=907_163)
EFFICIENTNET_STEP = 0.2089       # s, batch 64


def test_published_cpu_time_to_four_digits():
    assert f"{cpu_time(PUBLISHED, 19 * GB, 120e-9):.4g}" == "0.1673"
    result = check(PUBLISHED, EFFICIENTNET_STEP, link_bw=25 * GB, host_bw=19 * GB, host_latency=120e-9)
    assert result.hidden and f"{result.slack_s:.4g}" == f"{EFFICIENTNET_STEP - 0.167290:.4g}"


def test_ten_gb_per_second_fails_at_every_latency():
    latencies = [15e-9, 30e-9, 60e-9, 120e-9, 240e-9]
    rows = grid(PUBLISHED, EFFICIENTNET_STEP, 25 * GB, [10 * GB, 19 * GB], latencies)
    assert not any(c.hidden for c in rows[0])
    assert all(c.hidden for c in rows[1])                    # 19 GB/s holds at every latency
    assert min(c.cpu_s for c in rows[0]) > 0.3170


def test_storage_and_link_add_and_swaps_share_the_link():
    p = InputPipeline(batch_bytes=GB // 10, storage_bw=2 * GB, calls_per_thread=1, accesses=(1,), access_bytes=0)
    r = check(p, gpu_step=0.2, link_bw=GB, host_bw=GB, host_latency=0.0)
    assert r.storage_s == 0.05 and r.link_s == 0.1 and r.total_s == pytest.approx(0.15) and r.hidden
    # swap-ins hold the link for half the step: the batch gets half the bandwidth
    shared = check(p, gpu_step=0.2, link_bw=GB, host_bw=GB, host_latency=0.0, link_busy=0.1)
    assert shared.link_s == 0.2 and not shared.hidden and shared.slack_s == pytest.approx(-0.05)


def test_check_on_a_profile_uses_its_dram_and_link():
    hw = hardware.load("a100-80gb")
    r = check_on(PUBLISHED, hw, EFFICIENTNET_STEP)
    assert r.host_bw == hw.tiers["dram"].read_bw and r.host_latency == hw.tiers["dram"].latency
