"""Hardware profiles: presets load and list, costs follow the file, every bad file names the file and the key."""

from __future__ import annotations

import math

import pytest

from moe_offload.cli.main import main
from moe_offload.errors import ConfigError
from moe_offload.hardware import DEFAULT_PRESET, load_profile, preset_names, resolve_profile
from moe_offload.values import format_bytes, format_seconds, parse_bytes

PRESETS = ("desktop-rtx4090", "server-a100-pcie4", "server-h100-pcie5", "edge-flashmoe")

GOOD = """
name = "tiny"
description = "two tiers, one link"
sources = ["made up for a test"]

[[tiers]]
name = "gpu"
capacity_bytes = "1 KiB"

[[tiers]]
name = "host"
capacity_bytes = 4096

[[links]]
from = "host"
to = "gpu"
bandwidth_bytes_per_s = 100
latency_s = 0.5

[compute]
flops_per_s = 1e3
memory_bandwidth_bytes_per_s = 100
expert_overhead_s = 0.25
bytes_per_param = 2
attention = { fixed_s = 1.0, per_token_s = 0.1 }
router = { fixed_s = 0.25 }
lm_head = { fixed_s = 0.5, per_token_s = 0.0 }
"""


def write(tmp_path, text, name="profile.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_preset_loads_with_sources_and_a_chain_of_links():
    assert set(PRESETS) <= set(preset_names())
    assert DEFAULT_PRESET in preset_names()
    for name in PRESETS:
        profile = resolve_profile(name)
        assert profile.name == name
        assert profile.sources, f"{name} cites no source"
        assert [t.name for t in profile.tiers] == ["gpu", "host", "ssd"]
        assert [link.name for link in profile.links] == ["host->gpu", "ssd->host"]
        assert profile.compute.roofline is not None


def test_presets_carry_the_numbers_of_their_spec_sheets():
    edge = resolve_profile("edge-flashmoe")  # paper 003, Table 2 and section 4.1
    assert edge.tiers[0].capacity_bytes == 16 * 2**30          # RTX 5070 Ti 16 GB
    assert edge.tiers[1].capacity_bytes == 2**30              # ~1 GB of DRAM left for experts
    assert edge.link_from(2).bandwidth_bytes_per_s == 7.4e9   # SK hynix P51, 7.4 GB/s read
    desktop = resolve_profile("desktop-rtx4090")
    assert desktop.link_from(1).bandwidth_bytes_per_s == 25e9  # PCIe 4.0 x16, effective
    assert desktop.link_from(2).bandwidth_bytes_per_s == 7e9   # NVMe SSD
    assert resolve_profile("server-h100-pcie5").link_from(1).bandwidth_bytes_per_s == 50e9  # PCIe 5.0 x16
    assert resolve_profile(None).name == DEFAULT_PRESET


def test_costs_follow_the_file(tmp_path):
    profile = load_profile(write(tmp_path, GOOD))
    assert profile.name == "tiny" and profile.tiers[0].capacity_bytes == 1024
    link = profile.link_from(1)
    assert link.transfer_seconds(200) == pytest.approx(0.5 + 200 / 100)
    compute = profile.compute
    assert compute.attention(3) == pytest.approx(1.3)
    assert compute.router(50) == 0.25  # per_token_s defaults to 0
    # roofline: 200 bytes = 100 parameters, 200 FLOPs per token. One token: memory-bound, 200 B / 100 B/s = 2 s;
    # 20 tokens: 4000 FLOPs / 1000 FLOP/s = 4 s, compute-bound. Plus 0.25 s of overhead each.
    assert compute.expert_seconds(1, 200) == pytest.approx(2.25)
    assert compute.expert_seconds(20, 200) == pytest.approx(4.25)
    assert compute.slowdown_while_loading == 1.0 and link.slowdown_while_computing == 1.0  # shared nothing


def test_an_explicit_expert_cost_replaces_the_roofline_and_inf_bandwidth_costs_only_latency(tmp_path):
    text = GOOD.replace("bandwidth_bytes_per_s = 100\nlatency", "bandwidth_bytes_per_s = inf\nlatency").replace(
        "flops_per_s = 1e3\nmemory_bandwidth_bytes_per_s = 100\n", "expert = { fixed_s = 2.0, per_token_s = 0.5 }\n")
    profile = load_profile(write(tmp_path, text))
    assert profile.compute.expert_seconds(4, 10**9) == pytest.approx(4.0)
    assert profile.link_from(1).transfer_seconds(10**12) == 0.5
    assert math.isinf(profile.link_from(1).bandwidth_bytes_per_s)


@pytest.mark.parametrize("edit, key", [
    (lambda t: t.replace("[compute]", "[computing]"), "'compute'"),
    (lambda t: t.replace('capacity_bytes = "1 KiB"', 'capacity_bytes = "lots"'), "'tiers[0].capacity_bytes'"),
    (lambda t: t.replace("capacity_bytes = 4096", ""), "'tiers[1].capacity_bytes'"),
    (lambda t: t.replace("bandwidth_bytes_per_s = 100\nlatency", "bandwidth_bytes_per_s = -1\nlatency"),
     "'links[0].bandwidth_bytes_per_s'"),
    (lambda t: t.replace('from = "host"', 'from = "disk"'), "'links[0].from'"),
    (lambda t: t.replace('from = "host"\nto = "gpu"', 'from = "gpu"\nto = "host"'), "'links[0]'"),
    (lambda t: t[:t.index("[[links]]")] + t[t.index("[compute]"):], "'links'"),
    (lambda t: t.replace("attention = { fixed_s = 1.0, per_token_s = 0.1 }", ""), "'compute.attention'"),
    (lambda t: t.replace("router = { fixed_s = 0.25 }", "router = { fixed_s = 0.25, per_tok = 1 }"),
     "'compute.router.per_tok'"),
    (lambda t: t.replace("flops_per_s = 1e3\nmemory_bandwidth_bytes_per_s = 100\n", ""), "'compute.expert'"),
    (lambda t: t.replace("flops_per_s = 1e3", 'flops_per_s = "fast"'), "'compute.flops_per_s'"),
    (lambda t: t.replace("[compute]", "[compute]\nslowdown_while_loading = 0.5"), "'compute.slowdown_while_loading'"),
    (lambda t: t.replace("bandwidth_bytes_per_s = 100\nlatency", "slowdown_while_computing = 1e9\n"
                         "bandwidth_bytes_per_s = 100\nlatency"), "'links[0].slowdown_while_computing'"),
])
def test_a_bad_profile_names_the_file_and_the_key(tmp_path, edit, key):
    path = write(tmp_path, edit(GOOD))
    with pytest.raises(ConfigError) as error:
        load_profile(path)
    assert str(path) in str(error.value) and key in str(error.value)


def test_missing_unknown_and_malformed_profiles(tmp_path):
    with pytest.raises(ConfigError, match="no such hardware profile file"):
        load_profile(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="unknown hardware preset 'laptop'.*desktop-rtx4090"):
        resolve_profile("laptop")
    bad = write(tmp_path, "[[tiers]\nname = ", "broken.toml")
    with pytest.raises(ConfigError, match=f"{bad}: not a valid TOML"):
        resolve_profile(str(bad))


def test_byte_counts():
    assert parse_bytes("24 GiB", "x") == 24 * 2**30
    assert parse_bytes("12.5MB", "x") == 12_500_000
    assert parse_bytes(4096, "x") == 4096
    for bad in ("a lot", "-3GB", 0, "5 parsecs", True):
        with pytest.raises(ConfigError, match="^x "):
            parse_bytes(bad, "x")
    assert format_bytes(24 * 2**30) == "24 GiB" and format_bytes(25e9) == "25 GB"


def test_durations_print_in_the_unit_that_shows_them():
    assert [format_seconds(x) for x in (2.5, 0.0123, 4.56e-6, 9e-10, 0.0)] == ["2.5 s", "12.3 ms", "4.56 us",
                                                                               "0.9 ns", "0 ns"]


def test_hardware_command_lists_and_shows(tmp_path, capsys):
    assert main(["hardware", "list"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert main(["hardware", "show", "edge-flashmoe"]) == 0
    out = capsys.readouterr().out
    assert "ssd->host" in out and "paper 003" in out and "7.4 GB/s" in out
    assert main(["hardware", "show", str(write(tmp_path, GOOD)), "--expert-bytes", "200B"]) == 0
    out = capsys.readouterr().out
    assert "2500.000 ms" in out  # 0.5 s latency + 200 B at 100 B/s
    assert "no [host] compute" in out  # the table's name, not a console style
    assert main(["hardware", "show", "desktop-rtx4090"]) == 0
    # the preset's own words, brackets and all, not read as console styles
    assert "AMD Ryzen 9 7950X (the host assumed for [host])" in capsys.readouterr().out
    assert main(["hardware", "show", "laptop"]) == 2
    assert "unknown hardware preset" in capsys.readouterr().err
