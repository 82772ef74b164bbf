"""The dispatcher's liveness check against the order in which a failing worker's events arrive."""
import queue
import threading
from types import SimpleNamespace

from engine import messages as msg
from engine.facade.dispatch import Dispatcher
from engine.facade.requests import RequestTable


class _Exited:
    exitcode = None

    def is_alive(self) -> bool:
        return False


def _engine_with_one_exited_worker():
    logs = []
    worker = SimpleNamespace(index=0, state="loading", message="", process=_Exited(),
                             cfg=SimpleNamespace(device="cpu"))
    engine = SimpleNamespace(_workers=[worker], _events=queue.Queue(), _lock=threading.RLock(),
                             _stopping=False, requests=RequestTable(),
                             _log_line=lambda level, text, locked=False: logs.append(text),
                             _notify=lambda kind, payload: None)
    return engine, worker, logs


def test_a_worker_that_said_why_before_exiting_keeps_its_reason():
    # The worker queued its reason and exited before the dispatcher read the queue: the
    # liveness check runs first and must not report a silent exit over the real reason.
    engine, worker, logs = _engine_with_one_exited_worker()
    engine._events.put(msg.WorkerDead(0, "draft model x cannot draft for target y: eos differs"))
    Dispatcher(engine)._check_liveness()
    assert worker.state == "dead"
    assert worker.message.startswith("draft model x cannot draft for")
    assert all("exit code" not in line for line in logs)


def test_a_silent_exit_is_still_reported():
    engine, worker, _ = _engine_with_one_exited_worker()
    Dispatcher(engine)._check_liveness()
    assert worker.state == "dead" and "worker process exited" in worker.message
