"""Frozen suites are played in the format production calls the model in (loop/evaluation.py)."""

import pytest

from flywheel.config import ConfigError
from flywheel.loop.evaluation import SuiteConfig, as_format, format_warnings, suite_from_config
from flywheel.types import Task


def test_a_suite_plays_its_tasks_in_the_declared_format():
    raw = suite_from_config("arith", SuiteConfig(env="arithmetic", tasks=3))
    assert raw.formats == {"completion"} and raw.tasks[0].prompt == "58+08="
    chat = suite_from_config("arith", SuiteConfig(env="arithmetic", tasks=3, format="chat"))
    assert chat.formats == {"chat"}
    assert [t.prompt for t in chat.tasks] == [[{"role": "user", "content": t.prompt}] for t in raw.tasks]
    assert [(t.id, t.answer) for t in chat.tasks] == [(t.id, t.answer) for t in raw.tasks]
    calc = suite_from_config("calc", SuiteConfig(env="calculator", tasks=2, format="chat"))
    assert calc.formats == {"chat"}
    with pytest.raises(ConfigError, match=r"eval.suites.calc.format: completion, but task .* is a chat task"):
        suite_from_config("calc", SuiteConfig(env="calculator", tasks=2, format="completion"))


def test_as_format_keeps_what_is_already_in_that_format():
    chat = Task(id="a", prompt=[{"role": "user", "content": "hi"}], answer="x")
    raw = Task(id="b", prompt="hi", answer="x")
    assert as_format(chat, "chat", "w") is chat and as_format(raw, "completion", "w") is raw


def test_a_suite_in_another_format_than_production_is_warned_about():
    raw = suite_from_config("arith", SuiteConfig(env="arithmetic", tasks=2))
    chat = suite_from_config("chat_arith", SuiteConfig(env="arithmetic", tasks=2, format="chat"))
    (w,) = format_warnings([raw, chat], {"chat": 120, "completion": 0})
    assert w == ("suite 'arith' is played as completion but production is called as chat "
                 "(120 chat, 0 completion traces): set eval.suites.arith.format")
    assert format_warnings([raw, chat], {"chat": 0, "completion": 0}) == []  # no traffic: nothing to compare
    assert format_warnings([raw, chat], {"chat": 5, "completion": 5}) == []  # both served: both fit
