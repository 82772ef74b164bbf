"""The dashboard's keys that act on the engine: bursts, compare, a typed prompt, policies,
abort, tracing. A replay (app/replay.py) has no engine and turns these keys off.

A mixin of TokentopApp: it reads the app's engine, config and panels, and shows what happened
as notifications; a failing command is an error notification, never a traceback.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Iterable

from app.burst_runner import BurstPlan, BurstRun
from app.bursts import default_prompts_dir, list_burst_files, load_burst
from app.flags import describe_error   # engine messages with their settings as flags
from app.jobs import export_trace, in_background, run_compare, submit_prompt
from app.screens.burst import BurstDialog
from app.screens.compare import CompareDialog, CompareSpec
from app.screens.prompt import PromptDialog
from engine.config import ROUTER_POLICIES, SCHED_POLICIES


def reported(command: Callable) -> Callable:
    """A UI command whose failure becomes an error notification, never a traceback."""
    @functools.wraps(command)
    def run(self, *args):
        try:
            return command(self, *args)
        except Exception as exc:
            self.notify(describe_error(exc), severity="error", timeout=8)
    return run


def next_option(options: Iterable[str], current: str) -> str:
    options = tuple(options)
    return options[(options.index(current) + 1) % len(options)] if current in options else options[0]


class EngineCommands:
    def _finish_bursts(self) -> None:
        for run in [r for r in self.bursts if r.done]:
            self.bursts.remove(run)
            summary = run.summary()
            self.engine.log("info", summary.text())
            self.notify(summary.text(), title="burst finished", timeout=6)

    def _engine_ready(self) -> bool:
        if self.engine.ready:
            return True
        self.notify(self._start_error or "the engine is still starting: wait until a worker is ready",
                    severity="warning")
        return False

    @reported
    def action_burst(self) -> None:
        files = list_burst_files(default_prompts_dir())
        if not files:
            self.notify(f"no burst files (*.jsonl) in {default_prompts_dir()}", severity="error")
            return
        name = self._dialog("burst", lambda: BurstDialog(files))
        self.get_screen(name).set_files(files)
        self.push_screen(name, self.fire_burst)

    @reported
    def fire_burst(self, spec: BurstPlan | None) -> None:
        if spec is None or not self._engine_ready():
            return
        items = load_burst(spec.path)
        self.burst_count += 1
        if spec.max_tokens is not None and spec.temperature is not None:
            self.prompt_params = replace(self.prompt_params, max_tokens=spec.max_tokens,
                                         temperature=spec.temperature)
        name = f"{spec.path.stem}#{self.burst_count}"
        self.bursts.append(BurstRun(self.engine, spec, items, name).start())
        self.notify(f"burst {name}: {spec.count} requests from {spec.path}, one every {spec.interval_ms} ms")
        self._show_status()

    @reported
    def action_compare(self) -> None:
        if self._compare is not None and self._compare.is_alive():
            self.notify("a compare is still running; its result shows when both sides are done",
                        severity="warning")
            return
        files = list_burst_files(default_prompts_dir())
        if not files:
            self.notify(f"no burst files (*.jsonl) in {default_prompts_dir()}", severity="error")
            return
        self.push_screen(self._dialog("compare", lambda: CompareDialog(files)), self.start_compare)

    @reported
    def start_compare(self, spec: CompareSpec | None) -> None:
        if spec is None:
            return
        self._compare = in_background("compare", run_compare, self, spec, load_burst(spec.path))
        self.notify(f"compare {spec.path.name}: side A, then side B, each on a fresh engine…")

    def action_prompt(self) -> None:
        self.push_screen(self._dialog("prompt", PromptDialog), self.submit_prompt)

    @reported
    def submit_prompt(self, text: str | None) -> None:
        if text is None or not self._engine_ready():
            return
        if self.engine.needs_remote_counts():
            # submit asks a remote's /tokenize for the prompt's length there (up to its timeout)
            in_background("prompt", submit_prompt, self, text, self.prompt_params)
            return
        handle = self.engine.submit(text, params=self.prompt_params)
        self.notify(f"submitted {handle.id}")

    @reported
    def action_cycle_scheduler(self) -> None:
        self._cycle_policy("scheduler", SCHED_POLICIES, self.engine.set_scheduler_policy)

    @reported
    def action_cycle_router(self) -> None:
        self._cycle_policy("router", ROUTER_POLICIES, self.engine.set_router_policy)

    def _cycle_policy(self, kind: str, policies: Iterable[str], apply: Callable[[str], None]) -> None:
        """The next scheduler or router policy, applied, then shown in the header."""
        policy = next_option(policies, getattr(self, f"{kind}_policy"))
        apply(policy)
        setattr(self, f"{kind}_policy", policy)
        self._show_status()
        self.notify(f"{kind} policy: {policy}")

    @reported
    def action_cycle_spec(self) -> None:
        modes = self.engine.spec_modes()
        current = self.engine.spec_mode or self.config.workers[0].speculate
        mode = next_option(modes, current)
        self.engine.set_spec_mode(mode)
        self.notify(f"speculative decoding of new requests: {mode}")

    def _selected_request(self) -> str | None:
        """The request the table's, or the timeline's, cursor is on: whichever is shown."""
        shown = self.panels["timeline"] if self.panels["timeline"].display else self.panels["requests"]
        return shown.selected_id

    def action_abort(self) -> None:
        rid = self._selected_request()
        if rid is None:
            self.notify("no request selected: pick one in the request table", severity="warning")
        else:
            self.abort_request(rid)

    @reported
    def abort_request(self, rid: str) -> None:
        if self.engine.abort(rid):
            self.notify(f"aborting {rid}")
        else:
            self.notify(f"{rid} has already finished", severity="warning")

    @reported
    def action_toggle_tracing(self) -> None:
        self.engine.set_tracing(not self.engine.tracing)
        self._show_status()
        self.notify(f"trace detail: {self.engine.recorder.detail}")

    @reported
    def action_export_trace(self) -> None:
        # the flight recorder has kept the last window all along: write it now
        in_background("trace", export_trace, self)
        self.notify("writing the trace…")
