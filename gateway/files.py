"""Where the bytes of `/v1/files` are kept: as chunks of about 1 MiB in the database (`file_chunk`,
read by every replica), or as one file per id in the directory an operator names
(`SERVEGATE_FILE_STORE_DIR`, which every replica must share). Each file's row records which. Bytes
go in and come out a chunk at a time, so no file is ever whole in memory."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import delete as delete_rows
from sqlalchemy import event
from sqlmodel import Session, select

from gateway.tables import FileChunk, StoredFile

CHUNK_BYTES = 1024 * 1024


def chunks_of(stream: BinaryIO) -> Iterator[bytes]:
    """A binary stream's bytes, a chunk at a time."""
    return iter(lambda: stream.read(CHUNK_BYTES), b"")


def write(db, file: StoredFile, chunks: Iterable[bytes]) -> int:
    """Keeps `chunks` as the bytes of `file` where `file.directory` says; the number of bytes."""
    size = 0
    if file.directory is None:
        with Session(db) as session:
            for seq, data in enumerate(chunks):
                session.add(FileChunk(file_id=file.id, seq=seq, data=data))
                session.commit()  # a chunk per transaction: SQLite's one writer is never held for a whole file
                size += len(data)
        return size
    directory = Path(file.directory)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{file.id}.part"
    with partial.open("wb") as out:
        for data in chunks:
            size += out.write(data)
        out.flush()
        os.fsync(out.fileno())
    partial.replace(directory / file.id)  # whole or absent: a reader never finds half a file
    return size


def read(db, file: StoredFile) -> Iterator[bytes]:
    """The bytes of `file`, a chunk at a time."""
    if file.directory is not None:
        with (Path(file.directory) / file.id).open("rb") as stream:
            yield from chunks_of(stream)
        return
    for seq in itertools.count():
        with Session(db) as session:  # a session per chunk: a slow reader holds no connection between chunks
            data = session.exec(select(FileChunk.data).where(FileChunk.file_id == file.id,
                                                             FileChunk.seq == seq)).first()
        if data is None:
            return
        yield data


def delete(session: Session, file: StoredFile) -> None:
    """Deletes the bytes of `file` in the caller's transaction, which deletes its row: a directory's
    file goes once that transaction commits, so a delete rolled back loses nothing."""
    if file.directory is None:
        session.exec(delete_rows(FileChunk).where(FileChunk.file_id == file.id))
        return

    def unlink(_session) -> None:
        for name in (file.id, f"{file.id}.part"):
            (Path(file.directory) / name).unlink(missing_ok=True)

    event.listen(session, "after_commit", unlink, once=True)


def lines(chunks: Iterable[bytes], longest: int) -> Iterator[tuple[int, bytes | None]]:
    """Each non-blank line of JSONL bytes with its number (from 1), without its newline. A line
    longer than `longest` bytes comes as None, never held whole."""
    number, line, too_long = 0, bytearray(), False
    for chunk in chunks:
        for index, piece in enumerate(chunk.split(b"\n")):
            if index:  # a newline ended the line before this piece
                number += 1
                if too_long or line.strip():
                    yield number, None if too_long else bytes(line)
                line.clear()
                too_long = False
            if not too_long:
                line += piece
                if len(line) > longest:
                    too_long = True
                    line.clear()
    if too_long or line.strip():
        yield number + 1, None if too_long else bytes(line)


def chunked(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """Pieces (lines, say) gathered into chunks of about `CHUNK_BYTES`."""
    chunk = bytearray()
    for piece in pieces:
        chunk += piece
        if len(chunk) >= CHUNK_BYTES:
            yield bytes(chunk)
            chunk.clear()
    if chunk:
        yield bytes(chunk)
