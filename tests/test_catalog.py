"""Model catalog: assembly from parts, verification, locking, reuse, local paths, hub refs."""
from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.errors import ModelError
from engine.models import catalog
from engine.models.catalog import CatalogModel, list_models, resolve_model, tty_progress

REPO = Path(__file__).resolve().parents[1]


def _make_parts(tmp_path: Path) -> tuple[list[Path], bytes]:
    rng = __import__("random").Random(7)
    sizes = (300_000, 200_001, 5)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir(exist_ok=True)
    paths, data = [], b""
    for i, n in enumerate(sizes):
        chunk = rng.randbytes(n)
        p = parts_dir / f"part{i:02d}.bin"
        p.write_bytes(chunk)
        paths.append(p)
        data += chunk
    return paths, data


def _fake_model(tmp_path: Path, *, sha256: str | None = None, modules=("json",),
                packages=("fake-model-part1==1.0",), extra=None, list_parts=None) -> CatalogModel:
    paths, data = _make_parts(tmp_path)
    calls = tmp_path / "list_parts_calls"

    def counting_list_parts() -> list[Path]:
        with open(calls, "a") as f:   # a file, so calls from other processes count too
            f.write("x\n")
        return paths

    return CatalogModel(
        name="fake-model", description="test parts", arch="qwen2", size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(), packages=packages, modules=modules,
        list_parts=list_parts or counting_list_parts, extra=extra, aliases=("fake",),
    )


def _assembly_count(tmp_path: Path) -> int:
    calls = tmp_path / "list_parts_calls"
    return len(calls.read_text().splitlines()) if calls.exists() else 0


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def fake(tmp_path, monkeypatch, cache) -> CatalogModel:
    model = _fake_model(tmp_path)
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    return model


def test_assembles_parts_verifies_and_reports_progress(tmp_path, fake, cache):
    seen = []
    path = resolve_model("fake-model", progress=lambda done, total: seen.append((done, total)))
    assert path == cache / "fake-model.gguf"
    assert path.read_bytes() == b"".join(p.read_bytes() for p in sorted((tmp_path / "parts").iterdir()))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake.sha256
    assert seen[0] == (0, fake.size) and seen[-1] == (fake.size, fake.size)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    record = json.loads((cache / "fake-model.gguf.ok").read_text())
    assert record == {"size": fake.size, "mtime_ns": path.stat().st_mtime_ns, "sha256": fake.sha256}
    assert resolve_model("FAKE") == path   # aliases, case-insensitive


def test_wrong_checksum_fails_and_leaves_nothing(tmp_path, monkeypatch, cache):
    model = _fake_model(tmp_path, sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    with pytest.raises(ModelError, match="sha256 .* expected 0{64}.*pip install --force-reinstall"):
        resolve_model("fake-model")
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf.lock"]


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch, cache):
    model = _fake_model(
        tmp_path, modules=("json", "tokentop_test_absent_part2"),
        packages=("fake-model-part1==1.0", "fake-model-part2==1.0"),
    )
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    with pytest.raises(ModelError) as err:
        resolve_model("fake-model")
    assert "not installed" in str(err.value)
    assert str(err.value).endswith("Install it with: pip install 'fake-model-part2==1.0'")
    assert not (cache / "fake-model.gguf").exists()


def test_missing_optional_model_points_at_the_extra(tmp_path, monkeypatch, cache):
    model = _fake_model(tmp_path, modules=("tokentop_test_absent",), packages=("big-model==2.0",),
                        extra="models")
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    with pytest.raises(ModelError, match=r"pip install 'tokentop\[models\]'.*pip install 'big-model==2.0'"):
        resolve_model("fake-model")


def test_partly_installed_and_damaged_parts(tmp_path, monkeypatch, cache):
    def partly() -> list[Path]:
        raise ModuleNotFoundError("No module named 'fake_model_part3'")

    monkeypatch.setitem(catalog.CATALOG, "fake-model", _fake_model(tmp_path, list_parts=partly))
    with pytest.raises(ModelError, match="partly installed.*fake_model_part3.*pip install"):
        resolve_model("fake-model")

    model = _fake_model(tmp_path)
    (tmp_path / "parts" / "part02.bin").write_bytes(b"short")   # size unchanged: 5 bytes
    (tmp_path / "parts" / "part01.bin").write_bytes(b"truncated")
    monkeypatch.setitem(catalog.CATALOG, "fake-model", model)
    with pytest.raises(ModelError, match="damaged.*expected.*force-reinstall"):
        resolve_model("fake-model")


def _resolve_in_child(barrier, results) -> None:
    barrier.wait()
    first_call = []

    def slow_start(done: int, total: int) -> None:
        if not first_call:   # hold the lock a while so the other process surely has to wait
            first_call.append(1)
            time.sleep(0.3)

    path = resolve_model("fake-model", progress=slow_start)
    results.put((str(path), hashlib.sha256(path.read_bytes()).hexdigest()))


def test_two_processes_assemble_once(tmp_path, fake, cache):
    ctx = multiprocessing.get_context("fork")   # children inherit the patched catalog
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_child, args=(barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got[0] == got[1] == (str(cache / "fake-model.gguf"), fake.sha256)
    assert _assembly_count(tmp_path) == 1
    assert sorted(p.name for p in cache.iterdir()) == [
        "fake-model.gguf", "fake-model.gguf.lock", "fake-model.gguf.ok"]


def test_reuse_skips_hashing_until_the_file_changes(tmp_path, fake, cache, monkeypatch):
    path = resolve_model("fake-model")
    assert _assembly_count(tmp_path) == 1

    real_hash = catalog._hash_file
    hashed = []
    monkeypatch.setattr(catalog, "_hash_file", lambda p, progress: hashed.append(p) or real_hash(p, progress))
    assert resolve_model("fake-model") == path
    assert hashed == [] and _assembly_count(tmp_path) == 1

    # Touched but intact: re-verified once, not re-assembled, then trusted again.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model("fake-model") == path
    assert len(hashed) == 1 and _assembly_count(tmp_path) == 1
    assert resolve_model("fake-model") == path
    assert len(hashed) == 1

    # Same size, different bytes: re-verification fails and the file is assembled again.
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    assert resolve_model("fake-model") == path
    assert len(hashed) == 2 and _assembly_count(tmp_path) == 2
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake.sha256


def test_stale_partial_from_a_dead_process_is_removed(tmp_path, fake, cache):
    cache.mkdir(parents=True)
    stale = cache / ".fake-model.gguf.abc123.partial"
    stale.write_bytes(b"half a model")
    resolve_model("fake-model")
    assert not stale.exists()


def test_unwritable_cache_dir_says_what_to_do(tmp_path, fake, monkeypatch):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENTOP_CACHE_DIR", str(blocker))
    with pytest.raises(ModelError, match="TOKENTOP_CACHE_DIR"):
        resolve_model("fake-model")


def test_local_paths(tmp_path):
    model_file = tmp_path / "my model.gguf"
    model_file.write_bytes(b"GGUF")
    assert resolve_model(str(model_file)) == model_file
    with pytest.raises(ModelError, match="Model file not found: .*missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelError, match="not found"):
        resolve_model("missing.gguf")
    with pytest.raises(ModelError, match="is a directory"):
        resolve_model(str(tmp_path))


def test_a_path_that_is_not_a_regular_file_says_so(tmp_path):
    # /dev/zero was "Model file not found"
    with pytest.raises(ModelError, match=r"^/dev/zero is not a regular file \(it is a character device\); pass "
                                         r"the path of a \.gguf model file"):
        resolve_model("/dev/zero")
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match=r"is not a regular file \(it is a named pipe\)"):
        resolve_model(str(fifo))


def test_unknown_name_lists_choices():
    with pytest.raises(ModelError) as err:
        resolve_model("llama-70b")
    msg = str(err.value)
    for expected in ("'llama-70b'", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m",
                     ".gguf", "owner/repo/path/file.gguf"):
        assert expected in msg


def test_list_models(fake, cache):
    rows = {r["name"]: r for r in list_models()}
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"} <= set(rows)
    assert rows["qwen2.5-coder-0.5b"]["installed"] is True   # a base dependency of tokentop
    assert rows["gemma-3-270m"]["arch"] == "gemma3"
    assert rows["fake-model"]["assembled"] is False
    resolve_model("fake-model")
    row = next(r for r in list_models() if r["name"] == "fake-model")
    assert row["assembled"] is True and row["size"] == fake.size and row["path"].endswith("fake-model.gguf")


def test_real_catalog_part_lists_match_pinned_sizes():
    for model in catalog.CATALOG.values():
        if catalog._missing_packages(model):
            continue   # optional models may not be installed here
        assert sum(p.stat().st_size for p in model.list_parts()) == model.size, model.name


def _hf_cache_layout(hf_home: Path, repo_id: str, filename: str) -> Path:
    repo_dir = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(revision)
    target = repo_dir / "snapshots" / revision / filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")
    return target


def test_hub_ref_offline_fails_fast_with_advice(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelError) as err:
        resolve_model("someone/some-repo-GGUF/sub/model-q4.gguf")
    assert time.monotonic() - start < 3
    msg = str(err.value)
    assert "Cannot reach the Hugging Face Hub" in msg and "offline" in msg
    assert "download the file elsewhere and pass its path".lower() in msg.lower()
    assert "qwen2.5-coder-0.5b" in msg


def test_hub_ref_prefers_local_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = _hf_cache_layout(tmp_path / "hf", "someone/some-repo-GGUF", "sub/model-q4.gguf")
    assert resolve_model("someone/some-repo-GGUF/sub/model-q4.gguf") == cached


def test_hub_ref_unreachable_endpoint_fails_fast(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    code = (
        "import time; from engine.models.catalog import resolve_model\n"
        "t = time.monotonic()\n"
        "try: resolve_model('someone/some-repo-GGUF/model.gguf')\n"
        "except Exception as e: print(type(e).__name__, time.monotonic() - t, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    name, elapsed, msg = out.stdout.split(" ", 2)
    assert name == "ModelError", out.stderr
    assert float(elapsed) < 5
    assert "Cannot reach the Hugging Face Hub" in msg and "http://127.0.0.1:9" in msg


class _FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tty_progress_draws_a_bar():
    out = _FakeTTY()
    update = tty_progress("assembling qwen2.5-coder-0.5b", stream=out)
    update(245_000_000, 491_400_064)
    update(491_400_064, 491_400_064)
    text = out.getvalue()
    assert "\rassembling qwen2.5-coder-0.5b [##############................] 245/491 MB" in text
    assert text.endswith("[" + "#" * 30 + "] 491/491 MB\n")


def test_progress_without_tty_prints_start_and_end_lines():
    out = io.StringIO()
    update = tty_progress("assembling x", stream=out)
    for done in (0, 10, 20):
        update(done, 20)
    assert out.getvalue() == "assembling x: 0 MB ...\nassembling x: done\n"


@pytest.mark.realmodel
def test_real_default_model_resolves_and_reuse_is_fast():
    path = resolve_model("qwen2.5-coder-0.5b")
    assert path.stat().st_size == 491_400_064
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    record = json.loads(path.with_name(path.name + ".ok").read_text())
    assert record["sha256"] == catalog.CATALOG["qwen2.5-coder-0.5b"].sha256
    start = time.perf_counter()
    assert resolve_model("0.5b") == path
    assert time.perf_counter() - start < 0.1   # sidecar check only, no 491 MB re-hash
