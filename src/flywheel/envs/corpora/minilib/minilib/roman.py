"""Roman numerals from 1 to 3999."""

_VALUES = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"),
    (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]
_SYMBOLS = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
MAX_VALUE = 3999


def to_roman(number):
    """The Roman numeral of an integer in [1, 3999]."""
    if not isinstance(number, int) or isinstance(number, bool):
        raise TypeError("expected an integer")
    if number < 1 or number > MAX_VALUE:
        raise ValueError("out of range: %d" % number)
    parts = []
    for value, symbol in _VALUES:
        count, number = divmod(number, value)
        parts.append(symbol * count)
    return "".join(parts)


def from_roman(text):
    """The integer value of a Roman numeral (upper or lower case)."""
    text = text.strip().upper()
    if not text:
        raise ValueError("empty numeral")
    total = 0
    previous = 0
    for char in reversed(text):
        if char not in _SYMBOLS:
            raise ValueError("not a roman digit: %r" % char)
        value = _SYMBOLS[char]
        if value < previous:
            total -= value
        else:
            total += value
            previous = value
    return total


def is_roman(text):
    """True when `text` is a numeral in canonical form (the one to_roman writes)."""
    try:
        value = from_roman(text)
    except ValueError:
        return False
    if value < 1 or value > MAX_VALUE:
        return False
    return to_roman(value) == text.strip().upper()


def add(a, b):
    """Sum of two numerals, as a numeral."""
    return to_roman(from_roman(a) + from_roman(b))
