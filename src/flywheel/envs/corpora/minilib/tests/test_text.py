from minilib.text import (caesar, camel_to_snake, count_vowels, is_palindrome, rle_decode, rle_encode, slugify,
                          snake_to_camel, truncate, wrap)


def test_slugify():
    assert slugify("Hello, World!") == "hello-world"
    assert slugify("  many   spaces  ") == "many-spaces"


def test_slugify_separator():
    assert slugify("A b C", separator="_") == "a_b_c"


def test_camel_to_snake():
    assert camel_to_snake("parseHttpResponse") == "parse_http_response"
    assert camel_to_snake("Name") == "name"


def test_camel_to_snake_acronym():
    assert camel_to_snake("HTTPServer") == "httpserver"


def test_snake_to_camel():
    assert snake_to_camel("parse_http_response") == "parseHttpResponse"
    assert snake_to_camel("parse_http", upper_first=True) == "ParseHttp"


def test_snake_to_camel_edges():
    assert snake_to_camel("__") == ""
    assert snake_to_camel("_a__b_") == "aB"


def test_wrap_basic():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_wrap_exact_width():
    assert wrap("ab cd", 5) == ["ab cd"]
    assert wrap("ab cd", 4) == ["ab", "cd"]


def test_wrap_long_word():
    assert wrap("a extraordinary b", 5) == ["a", "extraordinary", "b"]


def test_wrap_empty_and_bad_width():
    assert wrap("", 3) == []
    try:
        wrap("x", 0)
    except ValueError:
        pass
    else:
        assert False, "width 0 accepted"


def test_rle_encode():
    assert rle_encode("aaabcc") == [("a", 3), ("b", 1), ("c", 2)]
    assert rle_encode("") == []


def test_rle_round_trip():
    for text in ["", "a", "abba", "zzzzzzy"]:
        assert rle_decode(rle_encode(text)) == text


def test_caesar():
    assert caesar("abc", 1) == "bcd"
    assert caesar("xyz", 3) == "abc"
    assert caesar("Hello, World", 13) == "Uryyb, Jbeyq"


def test_caesar_negative_shift():
    assert caesar("bcd", -1) == "abc"


def test_is_palindrome():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("palindrome")
    assert is_palindrome("")


def test_count_vowels():
    assert count_vowels("Education") == 5
    assert count_vowels("rhythm") == 0


def test_truncate():
    assert truncate("hello world", 8) == "hello..."
    assert truncate("short", 5) == "short"
    assert truncate("hello", 2) == ".."
