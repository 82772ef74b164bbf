"""One panel per worker: identity and state, load, throughput sparklines, KV page grid.

Built from the worker's config at start-up (so it shows before the engine has started),
then fed the worker's WorkerView from each snapshot, or model assembly progress while the
model file is being put together.
"""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.widgets import ProgressBar

from app.widgets.fmt import fmt_rate, short_model
from app.widgets.kv_grid import KVGrid
from app.widgets.line import Line
from app.widgets.rate_sparkline import RateSparkline
from engine.config import WorkerConfig
from engine.snapshot import WorkerView

STATE_STYLE = {"ready": "$success", "loading": "$warning", "starting": "$warning",
               "dead": "$error", "down": "$error", "stopped": "$text-muted"}


class BackendPanel(Vertical):
    def __init__(self, index: int, cfg: WorkerConfig) -> None:
        super().__init__(id=f"backend-{index}", classes="panel")
        self.index = index
        self.cfg = cfg
        self.border_title = escape(f"w{index} {cfg.name or cfg.device}")

    def compose(self) -> ComposeResult:
        yield Line(self._identity("starting", ""), classes="identity")
        yield Line("[$text-muted]waiting for the engine to start this worker…[/]", classes="load")
        with Horizontal(classes="rate"):
            yield Line("", classes="rate-label prefill-label")
            yield RateSparkline(classes="prefill-spark")
            yield Line("", classes="rate-profile prefill-profile")
        with Horizontal(classes="rate"):
            yield Line("", classes="rate-label decode-label")
            yield RateSparkline(classes="decode-spark")
            yield Line("", classes="rate-profile decode-profile")
        yield Line("", classes="kv-caption")
        yield KVGrid()
        yield ProgressBar(total=None, show_eta=False)

    def on_mount(self) -> None:
        # Looked up once: show_view runs five times a second.
        self._identity_line = self.query_one(".identity", Line)
        self._load = self.query_one(".load", Line)
        self._prefill_label = self.query_one(".prefill-label", Line)
        self._decode_label = self.query_one(".decode-label", Line)
        self._prefill_spark = self.query_one(".prefill-spark", RateSparkline)
        self._decode_spark = self.query_one(".decode-spark", RateSparkline)
        self._prefill_profile = self.query_one(".prefill-profile", Line)
        self._decode_profile = self.query_one(".decode-profile", Line)
        self._kv_caption = self.query_one(".kv-caption", Line)
        self._grid = self.query_one(KVGrid)
        self._bar = self.query_one(ProgressBar)

    def show_assembly(self, done: int, total: int) -> None:
        """Model file assembly progress (bytes), shown until the worker reports in."""
        self._bar.display = True
        self._bar.update(total=total or None, progress=done)
        self._identity_line.set(
            self._identity("loading", f"assembling {short_model(self.cfg.model)}: "
                                      f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB"))

    def show_failure(self, message: str) -> None:
        self.add_class("-dead")
        self._bar.display = False
        self._identity_line.set(self._identity("dead", message))

    def show_view(self, w: WorkerView) -> None:
        self.set_class(w.state == "dead", "-dead")
        if w.state in ("ready", "dead", "stopped"):
            self._bar.display = False
        self._identity_line.set(self._identity(w.state, w.message, w))
        self._load.set(f"running {w.running}/{w.max_active} · waiting {w.waiting} · {w.policy}")
        self._prefill_label.set(f"prefill {fmt_rate(w.prefill_tps):>5} t/s")
        self._decode_label.set(f"decode  {fmt_rate(w.decode_tps):>5} t/s")
        # The profile rates are what the cost router divides by.
        self._prefill_profile.set(f" prof {fmt_rate(w.profile_prefill_tps)}" if w.profile_prefill_tps else " prof —")
        self._decode_profile.set(f" prof {fmt_rate(w.profile_decode_tps)}" if w.profile_decode_tps else " prof —")
        self._prefill_spark.update_samples(w.prefill_history)
        self._decode_spark.update_samples(w.decode_history)
        if w.remote_url is not None:
            self._show_remote(w)
            return
        self._grid.update_states(w.page_states)
        if w.pages_total:
            used = 100.0 * w.pages_used / w.pages_total
            self._kv_caption.set(
                f"KV {used:.0f}% of {w.pages_total} pages×{w.page_size}, {self._grid.per_cell}/cell")

    def _show_remote(self, w: WorkerView) -> None:
        """A remote server: its URL, scraped load, measured rates; it has no page grid to draw."""
        self._grid.display = False
        kv = f", KV {100 * w.kv_usage:.0f}% (scraped)" if w.kv_usage is not None else ""
        self._kv_caption.set(escape(f"no KV grid{kv} · {w.note}" if w.note else f"no KV grid{kv}"))

    def _identity(self, state: str, message: str, w: WorkerView | None = None) -> str:
        style = STATE_STYLE.get(state, "$text")
        head = f"[bold {style}]● {state}[/]"
        if message and state != "ready":
            # The engine's messages often start with the state itself ("loading x on cpu").
            detail = message[len(state):].lstrip(" :") if message.startswith(state) else message
            return f"{head} [{style}]{escape(detail)}[/]"
        parts = [head]
        if self.cfg.simulated:
            parts.append("[reverse $warning] simulated [/]")
        if self.cfg.remote:
            parts.append(f"[reverse $accent] remote [/] {escape(self.cfg.device[len('remote:'):])}")
            if w is not None and w.model != self.cfg.model and w.state == "ready":
                parts.append(escape(short_model(w.model)))
            return " ".join(parts)
        parts.append(escape(short_model(self.cfg.model)))
        if w is not None and not w.simulated and w.dtype != "?":
            parts.append(escape(f"{w.dtype}/{w.weights}"))
        return " ".join(parts)
