"""Hardware profiles: presets, user files, transfers bounded by link and tier."""
from __future__ import annotations

import json

import pytest

from memsched import hardware
from memsched.errors import UserError
from memsched.hardware import GB, GiB


def test_presets_carry_the_spec_figures():
    a100 = hardware.load("a100-80gb")
    assert a100.device_memory == 80 * GiB and a100.memory_bandwidth == 2039 * GB
    assert a100.peak_flops["float32"] == 19.5e12 and a100.link_h2d == 25 * GB
    assert hardware.load("v100-16gb").link_d2h == 12 * GB and hardware.load("h100-80gb").link_d2h == 50 * GB
    assert set(hardware.PRESETS) == {"v100-16gb", "v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200"}
    for hw in hardware.PRESETS.values():
        assert set(hw.tiers) == {"dram", "nvdimm"}


def test_nvdimm_defaults_are_six_interleaved_optane_dimms():
    t = hardware.load("h200").tiers["nvdimm"]
    assert t.read_bw == 38 * GB and t.write_bw == pytest.approx(13.8 * GB) and t.latency == 350e-9
    one = hardware.optane_pmem(1)
    assert one.read_bw == 6.6 * GB and one.write_bw == 2.3 * GB


def test_nvdimm_transfer_is_bounded_by_link_and_tier():
    hw = hardware.load("a100-40gb")                  # link 25 GB/s each way
    n = 10**9
    # writing to NVDIMM: the tier (13.8 GB/s) is slower than the link
    assert hw.transfer_time(n, "nvdimm", "d2h") == pytest.approx(hw.link_latency + 350e-9 + n / 13.8e9, rel=1e-12)
    # reading NVDIMM (38 GB/s): the link is slower
    assert hw.transfer_time(n, "nvdimm", "h2d") == hw.link_latency + 350e-9 + n / (25 * GB)
    assert hw.transfer_time(n, "dram", "h2d") == hw.link_latency + hardware.DRAM_LATENCY + n / (25 * GB)
    with pytest.raises(UserError, match="no host tier 'ssd'"):
        hw.transfer_time(n, "ssd", "h2d")


def test_toml_profile_round_trips_through_json(tmp_path):
    toml = tmp_path / "box.toml"
    toml.write_text('''
name = "box"
device_memory = "24GiB"
memory_bandwidth = 1.0e12
launch_overhead = 4e-6
link_h2d = 20e9
link_d2h = 18e9
link_latency = 8e-6
[peak_flops]
float32 = 40e12
float16 = 160e12
[tiers.dram]
capacity = "256GiB"
read_bw = 100e9
write_bw = 90e9
latency = 100e-9
[op_class_flops]
conv = 30e12
''')
    hw = hardware.load(str(toml))
    assert hw.device_memory == 24 * GiB and hw.tiers["dram"].capacity == 256 * GiB
    assert hw.flops_for("conv", "float32") == 30e12 and hw.flops_for("gemm", "float16") == 160e12
    assert hw.flops_for("gemm", "int8") == 40e12    # an unknown dtype falls back to float32
    js = tmp_path / "box.json"
    js.write_text(json.dumps(hw.to_dict()))
    assert hardware.load(str(js)) == hw


@pytest.mark.parametrize("text, message", [
    ('name = "x"', "missing key"),
    ('device_memory = "lots"', "cannot read 'lots' as a size"),
    ("not toml [", "not a readable hardware profile"),
])
def test_bad_profiles_are_one_line_user_errors(tmp_path, text, message):
    base = hardware.load("v100-16gb").to_dict()
    path = tmp_path / "bad.toml"
    if text.startswith("device_memory"):
        base["device_memory"] = "lots"
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(base))
    else:
        path.write_text(text)
    with pytest.raises(UserError, match=message):
        hardware.load(str(path))


def test_negative_bandwidth_and_unknown_keys_are_rejected():
    base = hardware.load("v100-16gb").to_dict()
    with pytest.raises(UserError, match="link_h2d' must be positive"):
        hardware.from_dict({**base, "link_h2d": -1})
    with pytest.raises(UserError, match="unknown key"):
        hardware.from_dict({**base, "link_bw": 1})
    with pytest.raises(UserError, match="unknown hardware 'tpu-v9'"):
        hardware.load("tpu-v9")


def test_fitted_class_figures_are_checked():
    base = hardware.load("v100-16gb").to_dict()
    with pytest.raises(UserError, match="op_class_overhead.conv' must be seconds"):
        hardware.from_dict({**base, "op_class_overhead": {"conv": -1e-6}})
    with pytest.raises(UserError, match="op_class_loop' must be a table"):
        hardware.from_dict({**base, "op_class_loop": [1e-8]})
    hw = hardware.from_dict({**base, "op_class_overhead": {"gemm": 2e-6}, "op_class_loop": {"elementwise": 1e-8}})
    assert hw.op_class_overhead == {"gemm": 2e-6} and hw.has_class("elementwise") and not hw.has_class("conv")
