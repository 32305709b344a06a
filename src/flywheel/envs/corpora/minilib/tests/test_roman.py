from minilib.roman import add, from_roman, is_roman, to_roman


def _raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return True
    return False


def test_to_roman_basic():
    assert to_roman(1) == "I"
    assert to_roman(3) == "III"
    assert to_roman(8) == "VIII"


def test_to_roman_subtractive():
    assert to_roman(4) == "IV"
    assert to_roman(9) == "IX"
    assert to_roman(40) == "XL"
    assert to_roman(90) == "XC"
    assert to_roman(400) == "CD"
    assert to_roman(900) == "CM"


def test_to_roman_large():
    assert to_roman(1994) == "MCMXCIV"
    assert to_roman(3999) == "MMMCMXCIX"


def test_to_roman_range():
    assert _raises(ValueError, to_roman, 0)
    assert _raises(ValueError, to_roman, 4000)


def test_to_roman_type():
    assert _raises(TypeError, to_roman, 2.5)
    assert _raises(TypeError, to_roman, True)


def test_from_roman_basic():
    assert from_roman("III") == 3
    assert from_roman("LVIII") == 58


def test_from_roman_subtractive():
    assert from_roman("IV") == 4
    assert from_roman("MCMXCIV") == 1994


def test_from_roman_lowercase_and_spaces():
    assert from_roman(" xiv ") == 14


def test_from_roman_rejects():
    assert _raises(ValueError, from_roman, "")
    assert _raises(ValueError, from_roman, "XIZ")


def test_round_trip():
    for n in range(1, 400):
        assert from_roman(to_roman(n)) == n


def test_is_roman():
    assert is_roman("XIV")
    assert not is_roman("IIII")
    assert not is_roman("ABC")


def test_add():
    assert add("XIV", "VI") == "XX"
