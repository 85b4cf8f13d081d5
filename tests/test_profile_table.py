"""profile's table from given measurements: units, rows and the step-time warning."""

from actdesign.runtime.memory.profile import Profile, Run, size_unit, time_warning

GIB, MIB = 2**30, 2**20


def profile(baseline_times, compressed_times, scale=GIB):
    base = Run({"": 1 * scale, "h.0.mlp": 2 * scale}, 3 * scale + MIB, 4 * scale,
               sorted(baseline_times)[len(baseline_times) // 2], baseline_times, MIB)
    comp = Run({"": 1 * scale, "h.0.mlp": scale // 4}, 5 * scale // 4 + MIB, 2 * scale,
               sorted(compressed_times)[len(compressed_times) // 2], compressed_times, MIB)
    return Profile("m", "p", "batch 8, sequence 256", "cuda", "bf16-autocast",
                   "CUDA allocator", base, comp, report=None)


def test_the_unit_follows_the_largest_figure():
    assert size_unit(3_601_917_952) == (GIB, "GiB")  # 3,517,498.0 KiB before
    assert size_unit(GIB) == (GIB, "GiB")
    assert size_unit(GIB - 1) == (MIB, "MiB")
    assert size_unit(MIB) == (MIB, "MiB")
    assert size_unit(MIB - 1) == (1024, "KiB")


def test_table_in_gib_with_named_rows():
    table = profile([0.100, 0.101, 0.102], [0.120, 0.121, 0.122]).table()
    assert "baseline GiB" in table and "compressed GiB" in table
    rows = {line[:48].strip(): line[48:].split() for line in table.splitlines()[2:]}
    assert rows["(output and loss)"] == ["1.00", "1.00", "1.000"]
    assert rows["h.*.mlp"] == ["2.00", "0.25", "0.125"]
    assert rows["weight copies (once per step)"][:2] == ["0.00", "0.00"]  # 1 MiB
    assert rows["total"][:2] == ["3.00", "1.25"]
    assert rows["step time, ms: median"] == ["101.0", "121.0", "1.198"]
    assert rows["min-max of 3"] == ["100.0-102.0", "120.0-122.0"]
    assert "warning" not in table


def test_table_in_mib():
    assert "baseline MiB" in profile([0.1], [0.1], scale=MIB).table()


def test_a_spread_wider_than_the_difference_is_a_warning():
    assert time_warning([0.100, 0.101, 0.102], [0.120, 0.121, 0.122]) is None
    # one slow step among three, as a noisy machine gives
    warning = time_warning([0.100, 0.105, 35.3], [0.100, 0.110, 0.120])
    assert warning is not None and "differ by 5.0 ms" in warning
    assert "spread (35,200.0 ms)" in warning
    # the compressed model's spread counts as much as the baseline's
    assert time_warning([0.100, 0.100, 0.100], [0.090, 0.105, 0.200]) is not None
    table = profile([0.100, 0.105, 35.3], [0.100, 0.110, 0.120]).table()
    assert table.splitlines()[-1].startswith("warning: the step times differ by 5.0 ms")
