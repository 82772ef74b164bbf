"""`tokentop bench soak --minutes N`: mixed load for N minutes, one worker killed, the remote
restarted, and then the checks that nothing leaked, was lost or came twice.

Everything runs on 127.0.0.1 and is bounded in time and count:
* an Engine with two local worker processes (simulated by default: the real scheduler and KV
  accounting with timed waits, so the soak is cheap; `--device` replaces them) and one remote
  worker: a second `tokentop serve` subprocess, with a simulated worker, on a free port;
* the project's HTTP server over that engine, in this process, on another free port;
* load for the whole run: HTTP clients (httpx) sending streaming and whole completions and
  chats, some disconnecting mid-stream or before the answer; bursts submitted in process,
  some aborted; at a third of the run one local worker process is killed (SIGKILL; the engine
  must respawn it), at two thirds the remote server is terminated and started again on the
  same port (the engine must re-admit it);
* a sample every few seconds: RSS of this process, each worker process and the remote server
  (/proc), this process's open descriptors, KV pages held per worker, the request table, and
  the two ledgers (engine/bench/soak_checks.py).
When the load stops and the engine is idle, the verdicts: flat RSS (at most 5% growth after a
warm-up), no KV page held, no request lost or doubled, finished outputs complete, the killed
worker respawned and the remote re-admitted (each serves a request again). Requests the kill
and the restart failed are expected and counted apart. A failed verdict fails the command.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from engine.bench.llama_server import free_port
from engine.bench.soak_load import (ABORT_AFTER_FIRST, ABORT_NOW, BURST_EVERY_S, BURST_SIZE, MAX_TOKENS,
                                    STREAM_DISCONNECT, WHOLE_DISCONNECT, SoakClients)
from engine.bench.soak_checks import (
    ABORTED,
    FAILED,
    FINISHED,
    EngineLedger,
    Ledger,
    cached_pages,
    fd_verdict,
    held_pages,
    pages_verdict,
    rss_verdict,
    table_verdict,
)
from engine.config import EngineConfig, SamplingParams
from engine.errors import ConfigError, TokentopError, describe_error
from engine.facade.procstat import rss_bytes

ROOT = Path(__file__).resolve().parents[2]   # where `python -m app.cli` is this same tree
SERVE_COMMAND = (sys.executable, "-m", "app.cli", "serve")   # `tokentop serve`, run by this Python
DEFAULT_DEVICES = ("sim:soak0:prefill=3000,decode=150", "sim:soak1:prefill=3000,decode=150")
REMOTE_DEVICE = "sim:soakremote:prefill=3000,decode=150"
# every worker, the remote too, takes its turn: each disruption cuts real requests, and the
# engine notices the remote's restart by a request to it failing (the cost policy may send a
# remote measured slower than the local workers next to nothing)
ROUTER_POLICY = "round-robin"
MAX_ACTIVE = 8
HTTP_CLIENTS = 4
CLIENT_TIMEOUT_S = 60.0     # an HTTP request making no progress for this long has failed
DRAIN_S = 90.0              # after the load: for the clients' last requests to end
RECOVER_S = 120.0           # for a respawn, for the restarted server, for the re-admission
SETTLE_S = 30.0             # for the engine to be idle before the last sample
EXAMPLES = 30               # engine log lines (warnings and errors) kept for the report



class RemoteServer:
    """`tokentop serve` with one simulated worker on 127.0.0.1:port, in its own session (so a
    stop takes whatever it started), restartable on the same port."""

    def __init__(self, model: str, port: int, device: str = REMOTE_DEVICE):
        self.model, self.port, self.device = model, port, device
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.pids: list[int] = []
        self.healthy = False      # serving: its memory is judged from then on

    def start(self, timeout: float, cancelled: threading.Event) -> None:
        argv = [*SERVE_COMMAND, "--host", "127.0.0.1", "--port", str(self.port), "--device", self.device,
                "--worker-mode", "thread", "--max-active", str(MAX_ACTIVE), "--max-queue", "1000",
                "--model", self.model]
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, start_new_session=True)
        self.pids.append(self.proc.pid)
        deadline = time.monotonic() + timeout
        while not cancelled.is_set():
            if self.proc.poll() is not None:
                raise TokentopError(f"the remote `tokentop serve` exited with code {self.proc.returncode}: "
                                    f"{self.last_words()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.healthy = True
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TokentopError(f"the remote `tokentop serve` on {self.url} was not healthy within "
                                    f"{timeout:.0f} s: {self.last_words()}")
            time.sleep(0.2)

    def last_words(self) -> str:
        try:
            self._log.seek(0)
            lines = [line.strip() for line in self._log.read().splitlines() if line.strip()]
        except (OSError, ValueError):
            return "(no output)"
        return lines[-1] if lines else "(no output)"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def serving_pid(self) -> int | None:
        return self.pid if self.healthy else None

    def stop(self) -> None:
        """SIGTERM (the server's own clean stop), SIGKILL to its session if it lingers."""
        proc, self.proc, self.healthy = self.proc, None, False
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # anything it started and left
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def _mb(pid: int | None) -> float | None:
    rss = rss_bytes(pid) if pid else None
    return round(rss / 2**20, 1) if rss else None    # 0: a zombie, which has no memory to judge


def _open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """A process that still runs (a zombie has exited; only its entry is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _used_pages_on(url: str) -> int | None:
    """KV pages in use on a tokentop server's workers, from its /metrics; None if unreadable."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        r = httpx.get(url + "/metrics", timeout=3)
        if r.status_code != 200:
            return None
        return int(sum(s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples
                       if s.name == "tokentop:kv_pages" and s.labels.get("use") == "used"))
    except (httpx.HTTPError, ValueError):
        return None


class Soak:
    def __init__(self, args):
        self.duration = float(args.minutes) * 60
        self.model = args.model
        self.base = replace(args.worker, calibrate=False, max_active=MAX_ACTIVE,
                            threads=args.worker.threads or 2)
        self.local_devices = list(args.device or DEFAULT_DEVICES)
        self.interval = min(5.0, max(1.0, self.duration / 60))
        self.ledger, self.engine_ledger = Ledger(), EngineLedger()
        self.samples: list[dict] = []
        self.events: dict = {"worker_kill": {}, "remote_restart": {}}
        self.worker_pids: set[int] = set()
        self.cancelled = threading.Event()     # the run is over or failed: every wait ends
        self.remote: RemoteServer | None = None
        self.engine = self.http = None
        self.local: list[int] = []
        self.remote_index = -1
        self.t0 = time.monotonic()
        self.load_seconds = 0.0
        self.stalled = 0
        self.orphans: list[int] = []
        self.unfinished: list[dict] = []   # the engine's live requests once idle: each one lost
        self.log_tail: list[str] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    # --- start and stop ------------------------------------------------------------------
    def start(self) -> None:
        from engine.facade.devices import parse_devices
        from engine.facade.engine import Engine
        from engine.serve.app import ServeConfig
        from engine.serve.server import HttpServer

        self.remote = RemoteServer(self.model, free_port())
        self.remote.start(RECOVER_S, self.cancelled)
        workers = parse_devices(self.local_devices + [f"remote:{self.remote.url},name=remote"], self.base)
        self.local = [i for i, w in enumerate(workers) if not w.remote]
        self.remote_index = len(workers) - 1
        if not self.local:
            raise ConfigError("bench soak needs a local worker to kill; give a --device that is not remote:")
        self.engine = Engine(EngineConfig(workers=workers, router_policy=ROUTER_POLICY, worker_mode="process"))
        self.engine.add_observer(self.engine_ledger.observe)
        self.engine.start(timeout=RECOVER_S)
        self._note_worker_pids()
        if not self.wait_for(lambda: all(w.state == "ready" for w in self.engine.snapshot().workers), RECOVER_S):
            states = ", ".join(f"{w.name} {w.state}" + (f" ({w.message})" if w.message else "")
                               for w in self.engine.snapshot().workers)
            raise TokentopError(f"not every worker was ready within {RECOVER_S:.0f} s: {states}")
        self.http = HttpServer(self.engine, ServeConfig(port=0, max_queue=1000), quiet=True).start()
        if not self.wait_for(lambda: self._healthy(self.http.url), 30):
            raise TokentopError(f"the soak's HTTP server on {self.http.url} did not answer /health within 30 s")
        self.model_name = self.http.api.model

    def _note_worker_pids(self) -> None:
        """The local workers' processes now: each must be gone once the soak stops."""
        with self.engine.lock:
            self.worker_pids.update(w.process.pid for w in self.engine.workers
                                    if not w.cfg.remote and w.process is not None and w.process.pid)

    @staticmethod
    def _healthy(url: str) -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Everything this soak started, whatever happened before: then check that none of its
        processes outlived it."""
        self.cancelled.set()
        if self.engine is not None:
            self._note_worker_pids()
        for step in (lambda: self.http and self.http.stop(), lambda: self.engine and self.engine.shutdown(),
                     lambda: self.remote and self.remote.stop()):
            try:
                step()
            except Exception:   # noqa: BLE001 - the next ones must still run
                pass
        pids = self.worker_pids | set(self.remote.pids if self.remote else ())
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.orphans = sorted(p for p in pids if _alive(p))
        for pid in self.orphans:   # said in the report; not left running
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def wait_for(self, condition, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.cancelled.is_set() and time.monotonic() < deadline:
            if condition():
                return True
            time.sleep(0.2)
        return False

    # --- the load ---------------------------------------------------------------------------
    async def load(self) -> None:
        self.t0 = time.monotonic()
        stop = asyncio.Event()
        chaos = threading.Thread(target=self.chaos, name="tokentop-soak-chaos", daemon=True)
        sampler = asyncio.ensure_future(self.sampler())
        try:
            limits = httpx.Limits(max_connections=4 * HTTP_CLIENTS)
            async with httpx.AsyncClient(base_url=self.http.url, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
                clients = SoakClients(self.engine, self.model_name, self.ledger, self.now)
                tasks = [asyncio.ensure_future(clients.http_client(client, i, stop)) for i in range(HTTP_CLIENTS)]
                tasks.append(asyncio.ensure_future(clients.bursts(stop)))
                chaos.start()
                await asyncio.sleep(self.duration)
                while chaos.is_alive():        # a recovery still under way needs the load to notice it
                    await asyncio.sleep(0.5)
                self.load_seconds = self.now()
                stop.set()
                _, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
                self.stalled = len(pending)    # their requests stay open in the ledger: lost
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        except BaseException:
            self.cancelled.set()         # the disruptions' waits end too
            raise
        finally:
            if chaos.ident is not None:
                chaos.join(RECOVER_S)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)

    # --- the disruptions ------------------------------------------------------------------
    def chaos(self) -> None:
        """Kill one local worker at a third of the run, restart the remote at two thirds."""
        try:
            if self.cancelled.wait(self.duration / 3):
                return
            self.kill_worker()
            if self.cancelled.wait(max(0.0, self.t0 + 2 * self.duration / 3 - time.monotonic())):
                return
            self.restart_remote()
        except Exception as exc:   # noqa: BLE001 - in the report, and the verdicts fail
            self.events.setdefault("errors", []).append(describe_error(exc))

    def _view(self, index: int):
        return self.engine.snapshot().workers[index]

    def kill_worker(self) -> None:
        index = self.local[-1]
        ev = self.events["worker_kill"]
        with self.engine.lock:
            pid = self.engine.workers[index].process.pid
        ev.update(worker=index, name=self._view(index).name, pid=pid, at_s=self.now())
        os.kill(pid, signal.SIGKILL)
        if self.wait_for(lambda: self._view(index).state == "dead", 30):
            ev["dead_at_s"] = self.now()
        if self.wait_for(lambda: self._view(index).respawns >= 1 and self._view(index).state == "ready", RECOVER_S):
            ev["ready_again_at_s"] = self.now()
        with self.engine.lock:
            ev["new_pid"] = self.engine.workers[index].process.pid
        self.worker_pids.update((pid, ev["new_pid"]))
        ev["respawns"] = self._view(index).respawns

    def restart_remote(self) -> None:
        index, ev = self.remote_index, self.events["remote_restart"]
        ev.update(at_s=self.now(), old_pid=self.remote.pid)
        self.remote.stop()
        # the engine notices when a request to it fails; the load keeps sending some
        if self.wait_for(lambda: self._view(index).state != "ready", 60):
            ev["down_at_s"], ev["down_message"] = self.now(), self._view(index).message
        self.remote.start(RECOVER_S, self.cancelled)
        ev.update(started_at_s=self.now(), new_pid=self.remote.pid)
        if self.wait_for(lambda: self._view(index).state == "ready", RECOVER_S):
            ev["readmitted_at_s"] = self.now()

    # --- samples ----------------------------------------------------------------------------
    async def sampler(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(self.sample))
            await asyncio.sleep(self.interval)

    def sample(self) -> dict:
        snap = self.engine.snapshot()
        with self.engine.lock:
            procs = {i: self.engine.workers[i].process.pid for i in self.local}
        self.worker_pids.update(procs.values())
        # a process's memory counts once it serves: not while it imports and loads
        pids = {"main": os.getpid(), **{f"worker{i}": pid if snap.workers[i].state == "ready" else None
                                        for i, pid in procs.items()},
                "remote_server": self.remote.serving_pid}
        kv = {snap.workers[i].name: {"pages_used": snap.workers[i].pages_used,
                                     "pages_held": held_pages(snap.workers[i].page_states),
                                     "pages_cached": cached_pages(snap.workers[i].page_states),
                                     "pages_total": snap.workers[i].pages_total} for i in self.local}
        return {"t": self.now(), "rss_mb": {name: _mb(pid) for name, pid in pids.items()}, "pids": pids,
                "fds": _open_fds(), "kv": kv, "remote_server_pages_used": _used_pages_on(self.remote.url),
                "requests_in_table": len(snap.requests), "requests_live": sum(r.state.live for r in snap.requests),
                "workers": {w.name: w.state for w in snap.workers},
                "ledger": self.ledger.totals(), "engine_ledger": self.engine_ledger.totals()}

    # --- the end ------------------------------------------------------------------------------
    def finish(self) -> None:
        """After the load: both disrupted workers serve a request each, then the idle sample."""
        self.wait_for(lambda: all(w.state == "ready" for w in self.engine.snapshot().workers), RECOVER_S)
        for key, index in (("worker_kill", self.local[-1]), ("remote_restart", self.remote_index)):
            self.events[key]["served_after"] = self._probe(index)
        self.wait_for(self._idle, SETTLE_S)
        final = self.sample()
        final["final"] = True
        snap = self.engine.snapshot()
        self.unfinished = [{"id": r.id, "worker": r.worker, "state": str(r.state), "output_tokens": r.output_tokens,
                            "max_tokens": r.max_tokens, "age_s": round(r.age, 1), "burst": r.burst}
                           for r in snap.requests if r.state.live]
        self.log_tail = [f"{line.level}: {line.text}" for line in snap.log if line.level != "info"][-EXAMPLES:]
        self.samples.append(final)

    def _probe(self, index: int) -> bool:
        number = self.ledger.open(f"probe of worker {index}")
        try:
            res = self.engine.submit(f"probe of worker {index}", worker=index,
                                     params=SamplingParams(max_tokens=4, ignore_eos=True)).result(60)
        except (TokentopError, TimeoutError) as exc:
            self.ledger.close(number, FAILED, f"probe: {describe_error(exc)}")
            return False
        outcome = {"abort": ABORTED, "error": FAILED}.get(res.finish_reason, FINISHED)
        self.ledger.close(number, outcome, res.error or "")
        return res.finish_reason == "length" and res.worker == index

    def _idle(self) -> bool:
        snap = self.engine.snapshot()
        local = [snap.workers[i] for i in self.local]
        return (not any(r.state.live for r in snap.requests)
                and all(w.running == 0 and w.waiting == 0 for w in snap.workers)
                and all(w.pages_used == 0 and held_pages(w.page_states) == 0 for w in local)
                and _used_pages_on(self.remote.url) == 0)

    def report(self, error: str | None) -> dict:
        from engine.facade.requests import KEEP_FINISHED

        client, engine = self.ledger.summary(), self.engine_ledger.summary()
        final = self.samples[-1] if self.samples and self.samples[-1].get("final") else None
        kill, restart = self.events["worker_kill"], self.events["remote_restart"]
        verdicts = {"rss": rss_verdict(self.samples), "fds": fd_verdict(self.samples),
                    "kv_pages": pages_verdict(final) if final else {"ok": False, "why": "no idle sample"},
                    "request_table": table_verdict(final, KEEP_FINISHED) if final else {"ok": False},
                    "orphan_processes": self.orphans}
        goals = {
            "rss_flat_le_5pct": verdicts["rss"]["ok"],
            "no_leaked_pages": verdicts["kv_pages"]["ok"],
            "no_lost_requests": client["submitted"] > 0 and client["lost"] == 0 and engine["unfinished"] == 0,
            "no_doubled_requests": (client["doubled"] == 0 and client["streamed_after_finish"] == 0
                                    and engine["finished_twice"] == 0),
            "outputs_complete": client["finished"] > 0 and client["wrong_length"] == 0,
            "no_unexpected_failures": client["failed_unexpected"] == 0,
            "worker_respawned": bool(kill.get("respawns", 0) >= 1 and kill.get("ready_again_at_s") is not None
                                     and kill.get("new_pid") != kill.get("pid") and kill.get("served_after")),
            "remote_readmitted": bool(restart.get("down_at_s") is not None
                                      and restart.get("readmitted_at_s") is not None and restart.get("served_after")),
            "fds_flat": verdicts["fds"]["ok"],
            "request_table_bounded": verdicts["request_table"]["ok"],
            "no_orphan_processes": not self.orphans,
        }
        failed = [name for name, ok in goals.items() if not ok]
        if error is None and failed:
            error = "verdicts failed: " + ", ".join(failed)
        report = {
            "model": self.model, "minutes": self.duration / 60, "load_seconds": self.load_seconds,
            "sample_interval_s": self.interval, "router_policy": ROUTER_POLICY,
            "workers": {"local": self.local_devices, "remote": f"tokentop serve --device {REMOTE_DEVICE}"},
            "load": {"http_clients": HTTP_CLIENTS, "burst_every_s": BURST_EVERY_S, "burst_size": list(BURST_SIZE),
                     "max_tokens": list(MAX_TOKENS), "stream_disconnect": STREAM_DISCONNECT,
                     "whole_disconnect": WHOLE_DISCONNECT, "abort_now": ABORT_NOW,
                     "abort_after_first": ABORT_AFTER_FIRST},
            "events": self.events, "requests": {"client": client, "engine": engine, "stalled_clients": self.stalled,
                         "unfinished_in_engine": self.unfinished},
            "engine_log": self.log_tail,
            "verdicts": verdicts, "goals": goals, "samples": self.samples}
        if error:
            report["error"] = error
        return report


def bench_soak(args) -> dict:
    if getattr(args, "trace_dir", None):
        raise ConfigError("bench soak runs without a trace: one grows for the whole run and would read as "
                          "a leak; drop --trace-dir")
    if not float(args.minutes) > 0:
        raise ConfigError(f"--minutes must be more than 0, got {args.minutes}")
    soak = Soak(args)
    error = None
    try:
        soak.start()
        asyncio.run(soak.load())
        soak.finish()
    except Exception as exc:  # noqa: BLE001 - the report says what failed; stop() still runs
        error = describe_error(exc)
    finally:
        soak.stop()
    return soak.report(error)
