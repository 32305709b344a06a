"""Integer helpers: gcd and lcm, primes, factorization, digits, bases, searching."""

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def gcd(a, b):
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def lcm(a, b):
    if a == 0 or b == 0:
        return 0
    return abs(a * b) // gcd(a, b)


def is_prime(n):
    if n < 2:
        return False
    if n < 4:
        return True
    if n % 2 == 0:
        return False
    k = 3
    while k * k <= n:
        if n % k == 0:
            return False
        k += 2
    return True


def primes_up_to(limit):
    """All primes <= limit (sieve of Eratosthenes)."""
    if limit < 2:
        return []
    sieve = [True] * (limit + 1)
    sieve[0] = sieve[1] = False
    for p in range(2, int(limit ** 0.5) + 1):
        if sieve[p]:
            for multiple in range(p * p, limit + 1, p):
                sieve[multiple] = False
    return [i for i, prime in enumerate(sieve) if prime]


def factorize(n):
    """Prime factors of n >= 2 in increasing order, with repetition."""
    if n < 2:
        raise ValueError("n must be at least 2")
    factors = []
    d = 2
    while d * d <= n:
        while n % d == 0:
            factors.append(d)
            n //= d
        d += 1
    if n > 1:
        factors.append(n)
    return factors


def digit_sum(n):
    total = 0
    n = abs(n)
    while n > 0:
        total += n % 10
        n //= 10
    return total


def to_base(n, base):
    """The digits of integer n in `base` (2..36), with a leading '-' when negative."""
    if base < 2 or base > 36:
        raise ValueError("base must be in 2..36")
    if n == 0:
        return "0"
    sign = "-" if n < 0 else ""
    n = abs(n)
    digits = []
    while n:
        n, r = divmod(n, base)
        digits.append(DIGITS[r])
    return sign + "".join(reversed(digits))


def from_base(text, base):
    """Inverse of to_base."""
    text = text.strip().lower()
    sign = 1
    if text.startswith("-"):
        sign = -1
        text = text[1:]
    if not text:
        raise ValueError("no digits")
    value = 0
    for char in text:
        digit = DIGITS.find(char)
        if digit < 0 or digit >= base:
            raise ValueError("bad digit %r for base %d" % (char, base))
        value = value * base + digit
    return sign * value


def fibonacci(n):
    """The n-th Fibonacci number (fibonacci(0) == 0, fibonacci(1) == 1)."""
    if n < 0:
        raise ValueError("n must be non-negative")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def clamp(value, lo, hi):
    if lo > hi:
        raise ValueError("lo > hi")
    return max(lo, min(value, hi))


def binary_search(items, target):
    """Index of `target` in the sorted list `items`, or -1."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
