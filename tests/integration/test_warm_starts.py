"""The flawed teacher behind the arithmetic warm start (warm_starts.py), worked by hand."""

from warm_starts import carryless_sum, flawed_rows, forget_rate


def test_carryless_sum_forgets_every_carry_digit_by_digit():
    assert carryless_sum(57, 68) == 15  # 7 + 8 = 15 writes 5; 5 + 6 = 11 writes 1
    assert carryless_sum(50, 60) == 10  # the hundreds' 1 is a forgotten carry too
    assert carryless_sum(19, 1) == 10  # 9 + 1 writes 0, 1 + 0 = 1
    assert carryless_sum(23, 45) == 68  # no carry: the sum


def test_the_forget_rate_grows_with_the_first_carrying_digit_sum():
    assert forget_rate(23, 45) == 0.0
    assert forget_rate(55, 5) == 0.55  # units 10
    assert abs(forget_rate(57, 68) - 0.75) < 1e-12  # units 15
    assert abs(forget_rate(99, 99) - 0.87) < 1e-12  # units 18
    assert abs(forget_rate(50, 60) - 0.59) < 1e-12  # units 0, tens 11


def test_flawed_rows_hold_each_pairs_share_exactly():
    rows = flawed_rows([(57, 68), (23, 45)], copies=20)
    assert len(rows) == 40 and {r["prompt"] for r in rows} == {"57+68=", "23+45="}
    answers = [r["completion"] for r in rows if r["prompt"] == "57+68="]
    assert answers.count("15") == 15 and answers.count("125") == 5
    assert {r["completion"] for r in rows if r["prompt"] == "23+45="} == {"68"}
