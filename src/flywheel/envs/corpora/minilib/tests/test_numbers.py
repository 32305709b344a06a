from minilib.numbers import (binary_search, clamp, digit_sum, factorize, fibonacci, from_base, gcd, is_prime, lcm,
                             primes_up_to, to_base)


def _raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return True
    return False


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(-4, 6) == 2
    assert gcd(7, 0) == 7


def test_lcm():
    assert lcm(4, 6) == 12
    assert lcm(0, 5) == 0
    assert lcm(-3, 5) == 15


def test_is_prime_small():
    assert [n for n in range(-2, 20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]


def test_is_prime_squares():
    assert not is_prime(25)
    assert not is_prime(49)
    assert is_prime(97)


def test_primes_up_to():
    assert primes_up_to(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    assert primes_up_to(1) == []
    assert primes_up_to(2) == [2]


def test_primes_agree_with_is_prime():
    assert primes_up_to(200) == [n for n in range(201) if is_prime(n)]


def test_factorize():
    assert factorize(12) == [2, 2, 3]
    assert factorize(97) == [97]
    assert factorize(360) == [2, 2, 2, 3, 3, 5]


def test_factorize_square_of_prime():
    assert factorize(49) == [7, 7]


def test_factorize_rejects_small():
    assert _raises(ValueError, factorize, 1)


def test_digit_sum():
    assert digit_sum(12345) == 15
    assert digit_sum(-909) == 18
    assert digit_sum(0) == 0


def test_to_base():
    assert to_base(10, 2) == "1010"
    assert to_base(255, 16) == "ff"
    assert to_base(0, 7) == "0"
    assert to_base(-35, 36) == "-z"


def test_to_base_bad_base():
    assert _raises(ValueError, to_base, 5, 1)
    assert _raises(ValueError, to_base, 5, 37)


def test_from_base():
    assert from_base("1010", 2) == 10
    assert from_base("FF", 16) == 255
    assert from_base("-z", 36) == -35


def test_from_base_bad_digit():
    assert _raises(ValueError, from_base, "12", 2)
    assert _raises(ValueError, from_base, "-", 10)


def test_base_round_trip():
    for base in (2, 3, 10, 16, 36):
        for n in (-100, -1, 0, 1, 35, 36, 1000):
            assert from_base(to_base(n, base), base) == n


def test_fibonacci():
    assert [fibonacci(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]
    assert _raises(ValueError, fibonacci, -1)


def test_clamp():
    assert clamp(5, 0, 3) == 3
    assert clamp(-1, 0, 3) == 0
    assert clamp(2, 0, 3) == 2
    assert _raises(ValueError, clamp, 1, 3, 0)


def test_binary_search_found():
    items = [1, 3, 5, 7, 9, 11]
    for i, x in enumerate(items):
        assert binary_search(items, x) == i


def test_binary_search_missing():
    assert binary_search([1, 3, 5], 4) == -1
    assert binary_search([], 1) == -1
    assert binary_search([1, 3, 5], 6) == -1
