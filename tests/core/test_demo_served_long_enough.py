"""The demo's Perseus job runs until enough iterations ran under its newest served plan."""

from __future__ import annotations

from typing import Any

from zeus_demo.pipeline.run import ServedLongEnough


class Observer:
    """The versions the job announced as served so far (`JobObserver.versions("serving")`)."""

    def __init__(self) -> None:
        self.served: list[int] = []

    def versions(self, state: str) -> list[int]:
        assert state == "serving"
        return list(self.served)


def test_counts_from_the_first_sight_of_the_newest_plan() -> None:
    enough, observer = ServedLongEnough(5), Observer()
    job: Any = observer
    assert not any(enough(i, job) for i in range(1, 40))  # profiling: no plan yet, however long
    observer.served.append(3)  # served, first seen at iteration 40
    assert [enough(i, job) for i in range(40, 46)] == [False] * 5 + [True]
    observer.served.append(4)  # re-planned (a straggler): counted again from 46
    assert [enough(i, job) for i in range(46, 52)] == [False] * 5 + [True]
