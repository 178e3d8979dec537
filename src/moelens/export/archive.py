"""Writing the exported folder as an archive without machine identity, and reading it back.

torch-to-nnef writes ``graph.nnef`` and one ``.dat`` per tensor into a folder; tar
would record the user's name, ids and file times. moelens writes the archive itself:
members sorted, owner root/0 with no names, time 0, and no file name or time in the
gzip header, so the same export gives the same bytes on any machine (torch-to-nnef's own
naming follows Python's hash seed: fix ``PYTHONHASHSEED`` to compare exports across processes).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import secrets
import shutil
import stat
import tarfile
from pathlib import Path
from typing import NoReturn

from ..paths import blocked_above, may_write_into, user_path
from .errors import ExportError

#: Suffixes of an archive path (anything else is written as a folder).
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar")

#: The folder a folder export is copied into first, inside the target (left behind only by a killed export).
STAGING = re.compile(r"\.moelens-export-[0-9a-f]{12}\.part")

#: The files of an NNEF export besides its tensors (``<label>.dat``, one per variable the graph declares).
EXPORT_GRAPH_FILES = ("graph.nnef", "graph.quant")


def is_archive(path: Path) -> bool:
    """Whether ``path`` names an archive (``.nnef.tgz``, ``.tar.gz``, ``.tar``) rather than a folder."""
    return str(path).endswith(ARCHIVE_SUFFIXES)


def check_archive_name(named: str | os.PathLike, what: str = "to_nnef's path") -> None:
    """Refuse an export path whose name leaves archive or folder in doubt: an archive name ending with a slash
    (``Path`` drops it, and an archive was written), or an archive suffix in another case (written as a folder).
    An empty one is refused before, by `user_path`. ``what``: how the message names the path."""
    text = os.fspath(named)
    name = text.rstrip("/" + os.sep)
    if name != text and is_archive(Path(name)):
        raise ExportError(
            f"{what} {text!r} ends like an archive and with a slash, like a folder: drop the slash for an "
            f"archive, or name a folder without {', '.join(ARCHIVE_SUFFIXES)} at the end."
        )
    if not is_archive(Path(name)) and name.lower().endswith(ARCHIVE_SUFFIXES):
        raise ExportError(
            f"{what} {text!r} ends like an archive in another case, which would be written as a folder: "
            f"archives are named with a lower-case {', '.join(ARCHIVE_SUFFIXES)} at the end."
        )


def check_destination(path: str | os.PathLike) -> None:
    """Refuse a ``path`` that writing the export would clobber: nothing of the user's is replaced.

    A symbolic link is refused (whatever it points to). An archive path may be new, an empty file, or an earlier NNEF export archive (``graph.nnef``
    and tensor files only), which is replaced; any other file is refused, as is a folder. A folder
    path may be new, an empty folder, or an earlier NNEF export folder, which is replaced; a folder
    holding anything else is refused, not emptied. The nearest existing folder above ``path``
    must be a folder, not a file.

    Raises:
        ExportError: ``path`` is a symbolic link, a folder where an archive is asked for, a file where a folder
            is, a file or folder that is not an earlier export, or lies under a file.
    """
    path = user_path(path, error=ExportError)
    shown = repr(str(path))  # quoted: a path is no prose (the command respells setting names in prose)
    if path.is_symlink():
        raise ExportError(
            f"{shown} is a symbolic link (to {os.readlink(path)!r}); moelens neither writes through a link nor replaces "
            "it. Name the link's target, or a new path."
        )
    if is_archive(path):
        if path.is_dir():
            raise ExportError(f"{shown} is a folder, but its name asks for an archive; choose another name.")
        if path.is_file() and path.stat().st_size and not _is_export_archive(path):
            raise ExportError(
                f"{shown} is a file that is not an NNEF export; moelens replaces only an earlier export "
                "archive, never another file. Name a new archive (or move that file away first)."
            )
    elif path.exists() and not path.is_dir():
        raise ExportError(
            f"{shown} is a file; an export path is written as a folder unless it ends in "
            f"{', '.join(ARCHIVE_SUFFIXES)}. Name a new folder or an archive."
        )
    elif path.is_dir() and not may_write_into(path):
        raise ExportError(f"{shown} is a folder this user may not write into; name another folder or an archive.")
    elif path.is_dir() and any(path.iterdir()) and not _is_export_folder(path):
        raise ExportError(
            f"{shown} is a folder with files of its own; moelens writes a folder export only into a new "
            "or empty folder, or over an earlier NNEF export. Name a new folder (or an archive, *.nnef.tgz)."
        )
    # an archive is written beside itself; an existing folder is written into, nothing made above it
    blocked = None if path.is_dir() and not is_archive(path) else blocked_above(path)
    if blocked is not None:
        raise ExportError(f"{shown} lies under {blocked}; name a path in a folder you can write to.")


#: How an NNEF graph file begins (after comments) and declares its graph.
NNEF_VERSION = re.compile(r"(?:\s|#[^\n]*\n)*version\s+\d+\.\d+\s*;")
NNEF_GRAPH = re.compile(r"^\s*graph\s+\w+\s*\(", re.MULTILINE)
#: A variable's tensor file name in an NNEF graph (``label = 'name'``: its ``name.dat``).
NNEF_LABEL = re.compile(r"\blabel\s*=\s*'([^']*)'")


def _is_export_listing(names: list[str], graph: str) -> bool:
    """Whether these file names (relative to the export's root) are an NNEF export and nothing else: its
    ``graph.nnef`` (text ``graph``: an NNEF document, with its version and graph declaration), its quantization
    table, and a ``<label>.dat`` for variables the graph declares."""
    if not (NNEF_VERSION.match(graph) and NNEF_GRAPH.search(graph)):
        return False
    labels = set(NNEF_LABEL.findall(graph))
    return "graph.nnef" in names and all(
        name in EXPORT_GRAPH_FILES or (name.endswith(".dat") and name[: -len(".dat")] in labels) for name in names
    )


def _is_export_folder(path: Path) -> bool:
    """Whether ``path`` holds an NNEF export and nothing else (but copies of one an interrupted export left,
    `STAGING`, which the next export removes)."""
    leftovers = [entry for entry in path.iterdir() if STAGING.fullmatch(entry.name)]
    if not all(_is_staging_leftover(entry) for entry in leftovers):  # a folder of the user's named like one
        return False
    entries = [entry for entry in path.rglob("*") if not STAGING.fullmatch(entry.relative_to(path).parts[0])]
    if any(entry.is_dir() for entry in entries):  # an export is flat: a folder in it is the user's, even an empty one
        return False
    names = [entry.relative_to(path).as_posix() for entry in entries]
    if not names:  # nothing but what a killed export left
        return True
    if "graph.nnef" not in names and any(_moved_up_from(entry, names) for entry in leftovers):
        return True  # stopped while `_replace_folder` moved a new export's files up: they are that export's
    try:
        graph = (path / "graph.nnef").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return _is_export_listing(names, graph)


def _moved_up_from(staging: Path, names: list[str]) -> bool:
    """Whether the files ``names`` (a folder's, without a graph.nnef) are files of the export in ``staging`` that
    `_replace_folder` moved up before it was stopped: that export's graph.nnef is still in ``staging`` and names each."""
    try:
        graph = (staging / "graph.nnef").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return _is_export_listing(["graph.nnef", *names], graph)


def _is_staging_leftover(entry: Path) -> bool:
    """Whether ``entry`` (named like `STAGING`) is what an interrupted export left: a folder (no link) holding files
    of an export only (``graph.nnef``, ``graph.quant``, ``.dat`` tensors), perhaps not all of them yet."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    return all(file.is_file() and not file.is_symlink() and (file.name in EXPORT_GRAPH_FILES or file.suffix == ".dat")
               for file in entry.iterdir())


def _is_export_archive(path: Path) -> bool:
    """Whether the file ``path`` is a tar (or gzipped tar) of an NNEF export and nothing else."""
    try:
        with tarfile.open(path) as tar:
            names = [member.name for member in tar.getmembers() if not member.isdir()]
            member = tar.extractfile("graph.nnef")
            graph = member.read().decode("utf-8") if member is not None else ""
    except (OSError, tarfile.TarError, EOFError, KeyError, UnicodeDecodeError):
        return False
    return _is_export_listing(names, graph)


def write(folder: Path, path: Path) -> Path:
    """Write the files of ``folder`` to ``path``: a reproducible archive, or a folder copy.

    ``path`` is checked first (`check_destination`): only an earlier export is replaced (a folder's
    files; the folder itself is kept).
    """
    path = user_path(path, error=ExportError)
    check_destination(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not is_archive(path):
        _replace_folder(Path(folder), path)
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
    # A new file of a name of its own beside the archive (O_EXCL: never a file or link of the user's), renamed over it.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.part")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            if str(path).endswith(".tar"):
                file.write(buffer.getvalue())
            else:
                with gzip.GzipFile(filename="", mode="wb", fileobj=file, mtime=0, compresslevel=6) as gz:
                    gz.write(buffer.getvalue())
        if path.exists():  # an earlier export (or an empty file, `check_destination`): the new one keeps its mode
            os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
        temporary.replace(path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        _raise_write_failed(path, error)
    return path


def _raise_write_failed(path: Path, error: BaseException) -> NoReturn:
    """Re-raise ``error``, raised while writing the export to ``path`` (its partial copy removed), as an
    `ExportError` when it is the file system's (a full disk, a permission), else as it is (Ctrl-C)."""
    if isinstance(error, OSError):
        raise ExportError(f"writing the export to {path} failed ({error}); what was there is left as it was.") from error
    raise error


def _replace_folder(folder: Path, path: Path) -> None:
    """Put the export in ``folder`` into the folder ``path``, in place of the earlier export there.

    The files are first copied to a new hidden folder inside ``path``: a copy that fails (a full disk) leaves what
    was there as it was. Then the earlier export's files go (`check_destination` let nothing else through) and the
    new ones are moved up (renames). The folder itself stays (its mode, owner, and the current folder for ".").
    """
    path.mkdir(exist_ok=True)
    staging = path / f".moelens-export-{secrets.token_hex(6)}.part"  # a `STAGING` name
    try:
        shutil.copytree(folder, staging)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        _raise_write_failed(path, error)
    # graph.nnef goes last and comes last: stopped in between (Ctrl-C), the folder holds either the earlier graph with
    # some of its tensors or some of the new tensors without their graph (which stays in the staging folder); readers
    # refuse both as incomplete (`graph_text`), and the next export replaces either (`_is_export_folder`)
    last = lambda entry: entry.name == "graph.nnef"  # noqa: E731
    # an earlier export's staging leftover goes after the tensors (it may hold the graph.nnef that makes the tensors
    # an earlier stopped export moved up recognisable, `_moved_up_from`) and before graph.nnef
    deleted_last = lambda entry: (last(entry), bool(STAGING.fullmatch(entry.name)))  # noqa: E731
    for entry in sorted((entry for entry in path.iterdir() if entry != staging), key=deleted_last):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()  # a file, or a link (never followed)
    for entry in sorted(staging.iterdir(), key=last):
        entry.replace(path / entry.name)
    staging.rmdir()


def graph_text(path: Path) -> str:
    """The ``graph.nnef`` text of an archive or folder.

    Raises:
        ExportError: ``path`` is missing, or not an archive or folder holding ``graph.nnef``.
    """
    path = user_path(path, error=ExportError)
    try:
        if not is_archive(path):
            _refuse_incomplete(path)
            return (path / "graph.nnef").read_text()
        with tarfile.open(path) as tar:
            member = tar.extractfile("graph.nnef")
            return member.read().decode() if member is not None else ""
    except (OSError, tarfile.TarError, EOFError, KeyError, UnicodeDecodeError) as error:
        problem = "is not an NNEF export (it holds no readable graph.nnef)" if path.exists() else "does not exist"
        raise ExportError(
            f"{path} {problem}; pass an NNEF export written by moelens.export.to_nnef "
            f"(an archive {', '.join(ARCHIVE_SUFFIXES)}, or a folder)."
        ) from error


def _refuse_incomplete(path: Path) -> None:
    """Refuse a folder an export writing it was stopped in (`_replace_folder`): a staging copy left beside a graph
    whose tensors are not all there, or beside tensors without their graph."""
    if not path.is_dir() or not any(STAGING.fullmatch(entry.name) for entry in path.iterdir()):
        return
    graph = path / "graph.nnef"
    labels = set(NNEF_LABEL.findall(graph.read_text(encoding="utf-8"))) if graph.is_file() else None
    if labels is None or any(not (path / f"{label}.dat").is_file() for label in labels):
        raise ExportError(
            f"{path} is an incomplete NNEF export: an export writing it was stopped (Ctrl-C) while it replaced the "
            "files there (the hidden .moelens-export-*.part folder is what it left). Export to it again."
        )


def members(path: Path) -> list[tarfile.TarInfo]:
    """The archive's members (for checks of what it records)."""
    with tarfile.open(path) as tar:
        return tar.getmembers()


def size(path: Path) -> int:
    """Bytes on disk of an archive, or of a folder's files."""
    path = user_path(path, error=ExportError)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
