"""The demo base's SFT rows ask additions in every phrasing of ADD_PHRASINGS and never name
the later families' operations, so those stay new (demo/base.py)."""

import dataclasses
import re

from flywheel.demo.base import ADD_PHRASINGS, BASE_RECIPE, addition_demos


def test_every_phrasing_is_asked_and_no_new_operation_is():
    rows = addition_demos(dataclasses.replace(BASE_RECIPE, demos=96))  # 4 per (digits, phrasing)
    questions = [r["messages"][0]["content"] for r in rows]
    for phrasing in ADD_PHRASINGS:
        pattern = re.escape(phrasing).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+")
        assert sum(bool(re.fullmatch(pattern, q)) for q in questions) == 12, phrasing
    words = " ".join(questions).lower() + " ".join(str(r["messages"]) for r in rows)
    assert not any(w in words for w in ("minus", "times", "subtract", "multiply", " - ", " * "))
    # the call always adds the question's two numbers
    for r in rows:
        a, b = sorted(map(int, re.findall(r"\d+", r["messages"][0]["content"])))
        call = str(r["messages"][1])
        assert f"{a} + {b}" in call or f"{b} + {a}" in call
