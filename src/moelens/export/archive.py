"""Writing the exported folder as an archive without machine identity, and reading it back.

torch-to-nnef writes ``graph.nnef`` and one ``.dat`` per tensor into a folder; tar
would record the user's name, ids and file times. moelens writes the archive itself:
members sorted, owner root/0 with no names, time 0, and no file name or time in the
gzip header, so the same export gives the same bytes on any machine.
"""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from pathlib import Path

#: Suffixes of an archive path (anything else is written as a folder).
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar")


def is_archive(path: Path) -> bool:
    """Whether ``path`` names an archive (``.nnef.tgz``, ``.tar.gz``, ``.tar``) rather than a folder."""
    return str(path).endswith(ARCHIVE_SUFFIXES)


def write(folder: Path, path: Path) -> Path:
    """Write the files of ``folder`` to ``path``: a reproducible archive, or a folder copy."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not is_archive(path):
        if path.exists():
            shutil.rmtree(path)
        shutil.copytree(folder, path)
        return path
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for file in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            info = tarfile.TarInfo(file.relative_to(folder).as_posix())
            info.size = file.stat().st_size
            info.mode = 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(file, "rb") as handle:
                tar.addfile(info, handle)
    temporary = path.with_name(path.name + ".part")
    with open(temporary, "wb") as handle:
        if str(path).endswith(".tar"):
            handle.write(buffer.getvalue())
        else:
            with gzip.GzipFile(filename="", mode="wb", fileobj=handle, mtime=0, compresslevel=6) as gz:
                gz.write(buffer.getvalue())
    temporary.replace(path)
    return path


def graph_text(path: Path) -> str:
    """The ``graph.nnef`` text of an archive or folder."""
    path = Path(path)
    if not is_archive(path):
        return (path / "graph.nnef").read_text()
    with tarfile.open(path) as tar:
        member = tar.extractfile("graph.nnef")
        return member.read().decode() if member is not None else ""


def members(path: Path) -> list[tarfile.TarInfo]:
    """The archive's members (for checks of what it records)."""
    with tarfile.open(path) as tar:
        return tar.getmembers()


def size(path: Path) -> int:
    """Bytes on disk of an archive, or of a folder's files."""
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
