"""One panel per worker: identity and state, load and resources, throughput sparklines, KV page grid.

Built from the worker's config at start-up (so it shows before the engine has started),
then fed the worker's WorkerView from each snapshot, or model assembly progress while the
model file is being put together. A dead worker's panel is greyed and its live figures are
cleared: they describe a process that no longer exists. Fields of a line that does not fit
drop out by priority (Line.set_parts), so an 80-column terminal still reads.
"""
from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar

from app.widgets.fmt import fit_parts, fmt_mib, fmt_rate, outside_markup, short_model
from app.widgets.kv_grid import KVGrid
from app.widgets.line import Line
from app.widgets.rate_sparkline import RateSparkline
from engine.config import WorkerConfig
from engine.facade.snapshot import WorkerView

STATE_STYLE = {"ready": "$success", "loading": "$warning", "starting": "$warning",
               "dead": "$error", "down": "$error", "degraded": "$warning", "stopped": "$text-muted"}


class WorkerPanel(Vertical):
    def __init__(self, index: int, cfg: WorkerConfig) -> None:
        super().__init__(id=f"worker-{index}", classes="panel")
        self.index = index
        self.cfg = cfg
        self.border_title = outside_markup(f"w{index} {cfg.name or cfg.device}")

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
        yield Line("", classes="kv-caption prefix-caption")
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
        self._prefix_caption = self.query_one(".prefix-caption", Line)
        self._grid = self.query_one(KVGrid)
        self._bar = self.query_one(ProgressBar)

    def on_resize(self) -> None:
        self.set_class(self.content_region.width < 52, "-narrow")

    def show_assembly(self, done: int, total: int) -> None:
        """Model file assembly progress (bytes), shown until the worker reports in."""
        self._bar.display = True
        self._bar.update(total=total or None, progress=done)
        self._identity_line.set(self._identity("loading", "", None))     # state and model name
        self._load.set(f"[$warning]assembling the model file: "
                       f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB[/]")

    def show_failure(self, message: str) -> None:
        self.add_class("-dead", "-message")
        self._bar.display = False
        self._identity_line.set(self._identity("dead", "", None))
        self._load.set(f"[$error]{outside_markup(message)}[/]")

    def show_view(self, w: WorkerView) -> None:
        gone = w.state in ("dead", "stopped")
        self.set_class(gone, "-dead")
        if w.state in ("ready", "dead", "stopped"):
            self._bar.display = False
        self._identity_line.set(self._identity(w.state, "", w))
        # Loading and death messages are long ("measuring prefill / decode speed (first use
        # only)"): they get two wrapped lines instead of being cut.
        self.set_class(gone or bool(w.message and w.state != "ready"), "-message")
        if gone:
            self._show_gone(w)
            return
        if w.message and w.state != "ready":
            # Loading messages get the whole second line: they are long ("measuring prefill
            # / decode speed (first use only)") and the load figures mean nothing yet.
            style = STATE_STYLE.get(w.state, "$text")
            detail = w.message[len(w.state):].lstrip(" :") if w.message.startswith(w.state) else w.message
            self._load.set(f"[{style}]{outside_markup(detail)}[/]")
        else:
            self._load.set_parts(self._load_parts(w), sep="  ")
        self._prefill_label.set(f"prefill {fmt_rate(w.prefill_tps):>5} tok/s")
        self._decode_label.set(f"decode  {fmt_rate(w.decode_tps):>5} tok/s")
        # The profile rates are what the cost router divides by.
        self._prefill_profile.set(f"prof {fmt_rate(w.profile_prefill_tps)} tok/s" if w.profile_prefill_tps
                                  else "prof —")
        self._decode_profile.set(f"prof {fmt_rate(w.profile_decode_tps)} tok/s" if w.profile_decode_tps
                                 else "prof —")
        self._prefill_spark.update_samples(w.prefill_history)
        self._decode_spark.update_samples(w.decode_history)
        if w.remote_url is not None:
            self._show_remote(w)
            return
        self._grid.update_states(w.page_states)
        if w.pages_total:
            used = 100.0 * w.pages_used / w.pages_total
            parts = [(0, f"KV {used:.0f}%"),
                     (1, f"{w.pages_total} pages ({fmt_mib(w.kv_bytes)})" if w.kv_bytes
                      else f"{w.pages_total} pages"),
                     (3, f"{w.page_size} tok/page")]
            if self._grid.per_cell > 1:
                parts.append((2, f"{self._grid.per_cell} pages per cell"))
            self._kv_caption.set_parts(parts)
        self._prefix_caption.set_parts(prefix_parts(w))

    def _load_parts(self, w: WorkerView) -> list[tuple[int, str]]:
        parts = [(0, f"run {w.running}/{w.max_active} wait {w.waiting}")]
        if w.recomputed_tokens:     # only under KV pressure, and then it matters most
            parts.append((1, f"[$warning]recomputed {fmt_rate(w.recomputed_tokens)} tok[/]"))
        if w.cpu_percent is not None:
            parts.append((2, f"CPU {w.cpu_percent:.0f}%"))
        if w.rss_bytes is not None:
            parts.append((3, f"RSS {fmt_mib(w.rss_bytes)}"))
        parts += roofline_parts(w.roofline)
        parts.append((4, outside_markup(w.policy)))
        return parts

    def _show_gone(self, w: WorkerView) -> None:
        """A dead or stopped worker: say so, and blank every figure it can no longer update."""
        reason = w.message or ("stopped" if w.state == "stopped" else "exited")
        self._load.set(f"[$error]{outside_markup(reason)}[/]" if w.state == "dead" else outside_markup(reason))
        self._prefill_label.set("prefill     — tok/s")
        self._decode_label.set("decode      — tok/s")
        self._prefill_profile.set("")
        self._decode_profile.set("")
        self._prefill_spark.update_samples(())
        self._decode_spark.update_samples(())
        self._grid.update_states(b"")
        self._kv_caption.set("KV — (its pages went with it)" if w.state == "dead" else "KV —")
        self._prefix_caption.set("")

    def _show_remote(self, w: WorkerView) -> None:
        """A remote server: its URL, scraped load, measured rates; it has no page grid to draw."""
        self._grid.display = False
        kv = f", KV {100 * w.kv_usage:.0f}% (scraped)" if w.kv_usage is not None else ""
        self._kv_caption.set(outside_markup(f"no KV grid{kv} · {w.note}" if w.note else f"no KV grid{kv}"))

    def _identity(self, state: str, message: str, w: WorkerView | None = None) -> str:
        style = STATE_STYLE.get(state, "$text")
        head = f"[bold {style}]● {outside_markup(state)}[/]"
        if message and state != "ready":
            return f"{head} [{style}]{outside_markup(message)}[/]"
        parts = [(0, head)]
        if self.cfg.simulated:
            parts.append((0, "[reverse $warning] simulated [/]"))
        if self.cfg.remote:
            parts.append((0, f"[reverse $accent] remote [/] {outside_markup(self.cfg.device[len('remote:'):])}"))
            if w is not None and w.model != self.cfg.model and w.state == "ready":
                parts.append((1, outside_markup(short_model(w.model))))
        else:
            parts.append((0, outside_markup(short_model(self.cfg.model))))
        if w is not None and not w.simulated and not self.cfg.remote and w.dtype != "?":
            parts.append((2, outside_markup(w.dtype)))
            path = kernel_path(w)
            if path:
                parts.append((0 if w.kernels_building else 1, path))
        line = getattr(self, "_identity_line", None)
        return fit_parts(parts, line.size.width if line is not None and line.size.width else 10_000, sep=" ")


def roofline_parts(r: dict | None) -> list[tuple[int, str]]:
    """Decode steps' reads against the machine's measured read bandwidth; for many-row steps
    also their multiply-adds against the measured matmul peak."""
    if not r:
        return []
    read = f"read {r['read_gbs']:.1f} GB/s"
    if r.get("read_share") is not None:
        read += f" {100 * r['read_share']:.0f}% of {r['bandwidth_gbs']:.0f}"
    parts = [(1, read)]
    if r.get("rows", 1) >= 2 and r.get("compute_share") is not None:
        parts.append((3, f"{r['rows']:.0f} rows {100 * r['compute_share']:.0f}% of matmul peak"))
    return parts


def kernel_path(w: WorkerView) -> str:
    """Which path the linear layers run: the torch fallback while the kernels build (first use),
    the kernels and when they took over from it, or nothing once that is old news."""
    if w.kernels_building:
        return "[reverse $warning] torch matmuls [/] kernels building"
    if w.kernels_since:
        return f"kernels since {time.strftime('%H:%M:%S', time.localtime(w.kernels_since))}"
    return ""


def prefix_parts(w: WorkerView) -> list[tuple[int, str]]:
    """Prefix cache line: hit rate over the last ~30 s, cached pages, evictions, waits."""
    if not w.prefix_cache:
        return [(0, "prefix cache off")] if w.state == "ready" else []
    p = w.prefix
    hit = "—" if w.hit_rate is None else f"{100 * w.hit_rate:.0f}%"
    return [(0, f"prefix hit {hit}"), (1, f"cached {p.get('cached_pages', 0)}"),
            (2, f"evicted {p.get('evictions', 0)}"), (3, f"waits {p.get('single_flight_waits', 0)}")]
