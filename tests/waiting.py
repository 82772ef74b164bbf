"""Waiting on a condition in tests: poll until it holds, or fail saying what never happened."""
from __future__ import annotations

import time
from typing import Callable


def wait_until(condition: Callable[[], object], timeout: float, what: str, poll: float = 0.01):
    """Return the condition's first truthy value; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def pages_back(engine, timeout: float = 5.0) -> bool:
    """True once worker 0 holds no KV pages and runs or queues nothing (within `timeout` s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = engine.snapshot().workers[0]
        if w.pages_used == 0 and w.running == 0 and w.waiting == 0:
            return True
        time.sleep(0.05)
    return False
