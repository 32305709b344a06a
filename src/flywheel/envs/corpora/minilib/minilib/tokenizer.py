"""A tokenizer for arithmetic expressions, the shunting-yard algorithm and RPN evaluation."""

NUMBER, NAME, OP, LPAREN, RPAREN = "NUMBER", "NAME", "OP", "LPAREN", "RPAREN"
OPERATORS = "+-*/^"
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2, "^": 3}
RIGHT_ASSOCIATIVE = {"^"}


class TokenizeError(ValueError):
    """The text holds a character that is not part of any token."""


def tokenize(text):
    """Split `text` into (kind, value) pairs; numbers become int or float values."""
    tokens = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char.isdigit() or char == ".":
            start = i
            while i < len(text) and (text[i].isdigit() or text[i] == "."):
                i += 1
            literal = text[start:i]
            if literal.count(".") > 1 or literal == ".":
                raise TokenizeError("bad number %r at %d" % (literal, start))
            value = float(literal) if "." in literal else int(literal)
            tokens.append((NUMBER, value))
        elif char.isalpha() or char == "_":
            start = i
            while i < len(text) and (text[i].isalnum() or text[i] == "_"):
                i += 1
            tokens.append((NAME, text[start:i]))
        elif char in OPERATORS:
            tokens.append((OP, char))
            i += 1
        elif char == "(":
            tokens.append((LPAREN, char))
            i += 1
        elif char == ")":
            tokens.append((RPAREN, char))
            i += 1
        else:
            raise TokenizeError("unexpected %r at %d" % (char, i))
    return tokens


def to_rpn(tokens):
    """Reorder infix tokens into reverse Polish notation (shunting-yard)."""
    output = []
    stack = []
    for kind, value in tokens:
        if kind in (NUMBER, NAME):
            output.append((kind, value))
        elif kind == OP:
            while stack and stack[-1][0] == OP:
                top = stack[-1][1]
                if PRECEDENCE[top] > PRECEDENCE[value] or (
                        PRECEDENCE[top] == PRECEDENCE[value] and value not in RIGHT_ASSOCIATIVE):
                    output.append(stack.pop())
                else:
                    break
            stack.append((kind, value))
        elif kind == LPAREN:
            stack.append((kind, value))
        elif kind == RPAREN:
            while stack and stack[-1][0] != LPAREN:
                output.append(stack.pop())
            if not stack:
                raise ValueError("unbalanced ')'")
            stack.pop()
    while stack:
        kind, value = stack.pop()
        if kind == LPAREN:
            raise ValueError("unbalanced '('")
        output.append((kind, value))
    return output


def evaluate_rpn(tokens, variables=None):
    """Value of RPN tokens; NAME tokens are looked up in `variables`."""
    variables = variables or {}
    stack = []
    for kind, value in tokens:
        if kind == NUMBER:
            stack.append(value)
        elif kind == NAME:
            if value not in variables:
                raise KeyError(value)
            stack.append(variables[value])
        else:
            if len(stack) < 2:
                raise ValueError("not enough operands for %r" % value)
            right = stack.pop()
            left = stack.pop()
            if value == "+":
                stack.append(left + right)
            elif value == "-":
                stack.append(left - right)
            elif value == "*":
                stack.append(left * right)
            elif value == "/":
                stack.append(left / right)
            else:
                stack.append(left ** right)
    if len(stack) != 1:
        raise ValueError("malformed expression")
    return stack[0]


def evaluate(text, variables=None):
    """Value of an infix expression such as '2 * (x + 3)'."""
    return evaluate_rpn(to_rpn(tokenize(text)), variables)
