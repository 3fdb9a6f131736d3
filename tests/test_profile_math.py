"""The interval arithmetic benchmarks/profile_step.py reports lane overlap with."""

from profile_step import overlap_us, union_us


def test_union_merges_overlapping_and_nested_intervals():
    assert union_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert union_us([]) == 0


def test_overlap_counts_time_with_two_or_more_streams_busy():
    # stream 1 busy 0-10, stream 2 busy 5-20, stream 3 busy 8-9: >= 2 busy during 5-10
    assert overlap_us({1: [(0, 10)], 2: [(5, 20)], 3: [(8, 9)]}) == 5
    assert overlap_us({1: [(0, 10)], 2: [(10, 20)]}) == 0  # back to back is not overlap
