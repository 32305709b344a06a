from minilib.intervals import contains, gaps, insert, intersection, merge, normalize, overlaps, total_length


def test_normalize_orders_ends():
    assert normalize((5, 2)) == (2, 5)
    assert normalize((2, 5)) == (2, 5)


def test_overlaps_shared_point():
    assert overlaps((1, 3), (3, 6))
    assert overlaps((3, 6), (1, 3))


def test_overlaps_disjoint():
    assert not overlaps((1, 2), (4, 5))
    assert not overlaps((4, 5), (1, 2))


def test_overlaps_nested():
    assert overlaps((1, 10), (4, 5))


def test_merge_overlapping():
    assert merge([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]


def test_merge_touching_integers():
    assert merge([(1, 2), (3, 4)]) == [(1, 4)]


def test_merge_keeps_gap_of_one():
    assert merge([(1, 2), (4, 5)]) == [(1, 2), (4, 5)]


def test_merge_unsorted_and_reversed():
    assert merge([(9, 7), (1, 2), (2, 3)]) == [(1, 3), (7, 9)]


def test_merge_contained():
    assert merge([(1, 10), (2, 3)]) == [(1, 10)]


def test_merge_empty():
    assert merge([]) == []


def test_insert_bridges_two():
    assert insert([(1, 2), (6, 9)], (3, 5)) == [(1, 9)]


def test_total_length_counts_points():
    assert total_length([(1, 3)]) == 3
    assert total_length([(1, 3), (2, 5), (10, 10)]) == 6


def test_intersection():
    assert intersection((1, 5), (3, 9)) == (3, 5)
    assert intersection((1, 2), (5, 6)) is None


def test_gaps_inside_range():
    assert gaps([(2, 3), (6, 7)], 1, 9) == [(1, 1), (4, 5), (8, 9)]


def test_gaps_none_when_covered():
    assert gaps([(0, 10)], 2, 8) == []


def test_gaps_ignores_outside():
    assert gaps([(20, 30)], 1, 5) == [(1, 5)]


def test_contains():
    assert contains([(1, 3), (8, 5)], 6)
    assert contains([(1, 3)], 1)
    assert not contains([(1, 3)], 4)
