"""The dispatcher's liveness check against the order in which a failing worker's events arrive."""
import queue
import threading
from types import SimpleNamespace

from engine import messages as msg
from engine.facade.dispatch import Dispatcher
from engine.facade.requests import RequestTable
from engine.facade.workers import WorkerSet, WorkerSlot, WorkerState


class _Exited:
    exitcode = None

    def is_alive(self) -> bool:
        return False


def _engine_with_one_exited_worker():
    logs = []
    worker = WorkerSlot(0, SimpleNamespace(device="cpu", remote=False), queue.Queue(), _Exited(),
                        state=WorkerState.LOADING)
    workers = WorkerSet([worker.cfg], worker_mode="thread", trace_settings=None, worker_log=None)
    workers.slots, workers.events = [worker], queue.Queue()
    engine = SimpleNamespace(workers=workers, lock=threading.RLock(), stopping=False, requests=RequestTable(),
                             log=lambda level, text: logs.append(text), notify=lambda kind, payload: None)
    return engine, worker, logs


def test_a_worker_that_said_why_before_exiting_keeps_its_reason():
    # The worker queued its reason and exited before the dispatcher read the queue: the
    # liveness check runs first and must not report a silent exit over the real reason.
    engine, worker, logs = _engine_with_one_exited_worker()
    engine.workers.events.put(msg.WorkerDead(0, "draft model x cannot draft for target y: eos differs"))
    Dispatcher(engine)._check_liveness()
    assert worker.state == "dead"
    assert worker.message.startswith("draft model x cannot draft for")
    assert all("exit code" not in line for line in logs)


def test_a_silent_exit_is_still_reported():
    engine, worker, _ = _engine_with_one_exited_worker()
    Dispatcher(engine)._check_liveness()
    assert worker.state == "dead" and "worker process exited" in worker.message


def _serving_process_slot():
    workers = WorkerSet([SimpleNamespace(device="cpu", remote=False, model="m")], worker_mode="process",
                        trace_settings=None, worker_log=None)
    workers._paths = {"m": "/models/m.gguf"}
    slot = WorkerSlot(0, workers.configs[0], queue.Queue(), _Exited(), state=WorkerState.READY,
                      info=msg.WorkerInfo(name="cpu", model="m", device="cpu"))
    workers.slots = [slot]
    return workers, slot


def test_a_dead_serving_worker_is_respawned_with_backoff_then_given_up():
    workers, slot = _serving_process_slot()
    waits = []
    for death in range(4):
        now = 100.0 + death
        said = workers.note_death(slot, now)
        assert slot.state == WorkerState.DEAD and slot.stats is None
        if death < 3:
            waits.append(slot.respawn_at - now)
            assert "restarting" in said and workers.respawn_due(now) == []
            assert workers.respawn_due(slot.respawn_at) == [slot]
            slot.state = WorkerState.READY     # as if respawned and ready again
        else:
            assert "not restarted" in said and slot.respawn_at is None
            assert workers.respawn_due(now + 1e6) == []
    assert waits == [1.0, 2.0, 4.0]


def test_deaths_long_ago_do_not_count_against_a_worker():
    workers, slot = _serving_process_slot()
    for death in range(10):    # one death every ten minutes: always restarted
        assert "restarting in 1 s" in workers.note_death(slot, 600.0 * death)
        slot.state = WorkerState.READY


def test_a_worker_that_never_served_or_runs_in_a_thread_is_not_respawned():
    workers, slot = _serving_process_slot()
    slot.info = None                                  # died while starting: it would again
    assert workers.note_death(slot, 1.0) == "" and slot.respawn_at is None
    workers, slot = _serving_process_slot()
    workers.worker_mode = "thread"
    assert workers.note_death(slot, 1.0) == "" and slot.respawn_at is None


def test_every_event_a_worker_sends_has_its_handler():
    """An event is a message whose first field is the worker that sent it: each has one entry in
    the dispatcher's table (a new event without one would be dropped without a word)."""
    import dataclasses
    import inspect

    events = {cls for _, cls in inspect.getmembers(msg, inspect.isclass)
              if dataclasses.is_dataclass(cls) and cls.__module__ == msg.__name__
              and [f.name for f in dataclasses.fields(cls)][:1] == ["worker"]}
    engine, _, _ = _engine_with_one_exited_worker()
    handlers = Dispatcher(engine).handlers
    assert len(events) >= 11 and set(handlers) == events, set(handlers) ^ events


def test_state_events_move_the_slot_and_log_its_message():
    engine, worker, logs = _engine_with_one_exited_worker()
    d = Dispatcher(engine)
    d.apply(msg.WorkerDegraded(0, "stream silent for 30 s"))
    assert (worker.state, worker.message) == ("degraded", "stream silent for 30 s")
    d.apply(msg.WorkerDown(0, "connection refused"))
    assert (worker.state, worker.message) == ("down", "connection refused")
    d.apply(msg.WorkerLoading(0, "loading m"))
    assert (worker.state, worker.message) == ("loading", "loading m")
    assert logs == ["worker 0 (cpu) degraded: stream silent for 30 s", "worker 0 (cpu) down: connection refused"]
