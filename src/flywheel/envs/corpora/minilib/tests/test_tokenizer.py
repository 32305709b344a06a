from minilib.tokenizer import LPAREN, NAME, NUMBER, OP, RPAREN, TokenizeError, evaluate, to_rpn, tokenize


def _raises(exc, fn, *args):
    try:
        fn(*args)
    except exc:
        return True
    return False


def test_tokenize_numbers_and_ops():
    assert tokenize("12 + 3.5") == [(NUMBER, 12), (OP, "+"), (NUMBER, 3.5)]


def test_tokenize_names_and_parens():
    assert tokenize("(x_1*y)") == [(LPAREN, "("), (NAME, "x_1"), (OP, "*"), (NAME, "y"), (RPAREN, ")")]


def test_tokenize_no_spaces():
    assert tokenize("2^10") == [(NUMBER, 2), (OP, "^"), (NUMBER, 10)]


def test_tokenize_errors():
    assert _raises(TokenizeError, tokenize, "2 $ 3")
    assert _raises(TokenizeError, tokenize, "1.2.3")


def test_tokenize_empty():
    assert tokenize("   ") == []


def test_to_rpn_precedence():
    rpn = to_rpn(tokenize("1 + 2 * 3"))
    assert [v for _, v in rpn] == [1, 2, 3, "*", "+"]


def test_to_rpn_left_associative():
    assert [v for _, v in to_rpn(tokenize("8 - 3 - 2"))] == [8, 3, "-", 2, "-"]


def test_to_rpn_parentheses():
    assert [v for _, v in to_rpn(tokenize("(1 + 2) * 3"))] == [1, 2, "+", 3, "*"]


def test_to_rpn_unbalanced():
    assert _raises(ValueError, to_rpn, tokenize("(1 + 2"))
    assert _raises(ValueError, to_rpn, tokenize("1 + 2)"))


def test_evaluate_arithmetic():
    assert evaluate("1 + 2 * 3") == 7
    assert evaluate("(1 + 2) * 3") == 9
    assert evaluate("10 / 4") == 2.5


def test_evaluate_subtraction_order():
    assert evaluate("10 - 4 - 3") == 3


def test_evaluate_power_right_associative():
    assert evaluate("2 ^ 3 ^ 2") == 512


def test_evaluate_variables():
    assert evaluate("2 * (x + 3)", {"x": 4}) == 14


def test_evaluate_unknown_variable():
    assert _raises(KeyError, evaluate, "y + 1")


def test_evaluate_malformed():
    assert _raises(ValueError, evaluate, "1 +")
    assert _raises(ValueError, evaluate, "1 2")
