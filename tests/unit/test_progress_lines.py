"""Progress off a terminal (issue 35, point 9): a piped log gets a plain line every ~10 s
instead of a bar that draws nothing. A fake clock drives the time."""

from __future__ import annotations

from flywheel.train.progress import LineProgress, StepProgress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_every_ten_seconds_and_one_at_the_end():
    clock, lines = Clock(), []
    p = LineProgress("day 1 traffic", 520, clock=clock, write=lines.append)
    for done in range(1, 521):  # one episode every 0.125 s: 65 s in all
        clock.t += 0.125
        p.update(done, f"{done // 2} solved")
    p.close()
    assert len(lines) == 7  # at 10, 20, ... 60 s, and the closing line at 65 s
    assert lines[0] == "day 1 traffic: 80/520 (15%), 40 solved, 10 s elapsed, eta 55 s"
    assert lines[1].startswith("day 1 traffic: 160/520 (31%), 80 solved, 20 s elapsed")
    assert lines[-1] == "day 1 traffic: 520/520 (100%), 260 solved, 65 s elapsed"  # done: no eta


def test_the_closing_line_is_not_a_repeat():
    clock, lines = Clock(), []
    p = LineProgress("x", 4, clock=clock, write=lines.append)
    for done in range(1, 5):
        clock.t += 5.0
        p.update(done)
    p.close()  # the 20 s line already said 4/4
    assert lines == ["x: 2/4 (50%), 10 s elapsed, eta 10 s", "x: 4/4 (100%), 20 s elapsed"]


def test_step_progress_prints_lines_off_a_terminal(capsys):
    clock, lines = Clock(), []
    with StepProgress(3000, start=1000, description="sft", clock=clock, write=lines.append) as p:
        assert p.plain  # pytest captures stdout: not a terminal
        for step in range(1001, 3001):
            clock.t += 0.0625
            p.update(step, 0.41234, 12345.6)
    # the rate counts from the start step: 160 steps in 10 s, 1,840 to go
    assert lines[0] == "sft: 1,160/3,000 (39%), loss 0.4123, 12,346 tok/s, 10 s elapsed, eta 115 s"
    assert len(lines) == 13 and lines[-1] == "sft: 3,000/3,000 (100%), loss 0.4123, 12,346 tok/s, 2.1 min elapsed"
    assert capsys.readouterr().out == ""  # no bar was drawn
    with StepProgress(10, enabled=False, clock=clock, write=lines.append) as p:
        clock.t += 60
        p.update(10, 0.1, 1.0)
    assert len(lines) == 13  # disabled: silent


def test_work_shorter_than_the_interval_stays_silent():
    clock, lines = Clock(), []
    p = LineProgress("x", 10, clock=clock, write=lines.append)
    for done in range(1, 11):
        clock.t += 0.5
        p.update(done)
    p.close()
    assert lines == []


def test_count_progress_follows_its_console():
    import io

    from rich.console import Console

    from flywheel.train.progress import CountProgress

    clock, lines = Clock(), []
    piped = Console(file=io.StringIO())  # not a terminal
    with CountProgress("day 1 traffic on v1", 100, piped, clock=clock, write=lines.append) as p:
        for done in range(1, 101):
            clock.t += 0.25
            p.update(done, f"{done} solved")
    assert lines == ["day 1 traffic on v1: 40/100 (40%), 40 solved, 10 s elapsed, eta 15 s",
                     "day 1 traffic on v1: 80/100 (80%), 80 solved, 20 s elapsed, eta 5 s",
                     "day 1 traffic on v1: 100/100 (100%), 100 solved, 25 s elapsed"]
    assert piped.file.getvalue() == ""
    terminal = Console(file=io.StringIO(), force_terminal=True)
    with CountProgress("x", 3, terminal, clock=clock, write=lines.append) as p:
        assert not p.plain
        p.update(3, "3 solved")
    assert len(lines) == 3  # the bar drew on the terminal instead
