"""The database engine: a SQLite file in the user data dir by default, any SQLAlchemy URL allowed."""
from __future__ import annotations

import importlib
import logging
import os
import sqlite3
from pathlib import Path

import platformdirs
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex
from sqlalchemy.pool import StaticPool
from sqlmodel import SQLModel, create_engine

DB_URL_ENV = "SWIFT_STUDIO_DB"
log = logging.getLogger(__name__)


def default_db_url() -> str:
    url = os.environ.get(DB_URL_ENV)
    if url:
        return url
    data = Path(platformdirs.user_data_dir("swift-studio"))
    private_dir(data)
    return f"sqlite:///{data / 'studio.db'}"


def private_dir(path: Path) -> None:
    """Create a directory for its owner only (whatever the umask); an existing one is left as it is."""
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)


SQLITE_HEADER = b"SQLite format 3\x00"


class DatabaseFileError(Exception):
    """The database file is not one this studio can open; the message names it. It is never
    changed: a run history is not replaced by a new, empty database."""


def private_sqlite_file(path: Path) -> None:
    """The database holds run specs with their env values (tokens, keys): owner-only. SQLite gives
    its -wal, -shm and -journal files the database file's mode, so a new database is made 0600
    (whatever the umask) under a temporary name and linked into place whole: another process
    starting at the same moment finds either no file or a database, never an empty file. An
    existing file must be an SQLite database; one left more open (by an older version) is
    tightened, with its companions."""
    private_dir(path.parent)
    if not os.path.lexists(path):
        temp = path.with_name(f".{path.name}.{os.getpid()}.new")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        os.close(fd)
        try:
            conn = sqlite3.connect(temp)
            conn.execute("PRAGMA journal_mode=WAL")  # writes the header: the file is a database from here on
            conn.close()
            os.link(temp, path)
        except FileExistsError:
            pass  # another process made it first: theirs is used
        finally:
            for leftover in (temp, Path(f"{temp}-wal"), Path(f"{temp}-shm")):
                leftover.unlink(missing_ok=True)
    _check_sqlite_file(path)
    for name in (path, *(Path(f"{path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))):
        try:
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot make %s private (chmod 600 it yourself): %s", name, exc)


def _check_sqlite_file(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except IsADirectoryError:
        raise DatabaseFileError(f"database {path} is a directory, not a database file") from None
    except OSError as exc:
        raise DatabaseFileError(f"database {path}: cannot read ({exc.strerror})") from None
    if not head:
        # SQLite makes an empty file a new database; a reader that opened the path before the
        # database existed leaves one. Said, not refused: there is nothing in it to lose.
        log.warning("database %s was an empty file: a new database is made in it", path)
        return
    if head != SQLITE_HEADER:
        raise DatabaseFileError(f"database {path} is not an SQLite database (it does not start with "
                                f"{SQLITE_HEADER[:15].decode()!r}); it was left untouched: give another --db, or "
                                "move it away to start a new database there")


def make_engine(url: str | None = None) -> Engine:
    url = url or default_db_url()
    if url.startswith("sqlite"):
        memory = url in ("sqlite://", "sqlite:///:memory:")
        parsed = make_url(url)
        if not memory and parsed.database and not parsed.query.get("uri"):
            private_sqlite_file(Path(parsed.database))
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30},
            **({"poolclass": StaticPool} if memory else {}))
        if not memory:
            # WAL lets the UI read while the control plane and ingest write.
            @event.listens_for(engine, "connect")
            def _pragmas(conn, _record):
                cur = conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.close()
        return engine
    return create_engine(url, pool_pre_ping=True)


def create_db_and_tables(engine: Engine) -> None:
    importlib.import_module("backend.store.models")
    importlib.import_module("backend.store.telemetry_models")
    create_tables(engine, SQLModel.metadata.sorted_tables)


def create_tables(engine: Engine, tables) -> None:
    """Create the missing tables and bring older ones up to date; a database that cannot be read
    (corrupt pages, not a database) is a DatabaseFileError naming it, left as it is."""
    # create_all looks, then creates: a process starting beside this one may create a table or an
    # index in between, and looking again finds it. Each such clash is one more made by another
    # process, so there are at most as many as there are tables and indexes.
    tries = 1 + sum(1 + len(t.indexes) for t in tables)
    for tries_left in range(tries - 1, -1, -1):
        try:
            SQLModel.metadata.create_all(engine, tables=tables)
            upgrade_tables(engine, tables)
            return
        except DBAPIError as exc:
            if tries_left and "already exists" in str(exc.orig):
                continue
            raise DatabaseFileError(f"database {engine.url.render_as_string(hide_password=True)}: cannot be "
                                    f"opened ({exc.orig}); it was left untouched") from None


def upgrade_tables(engine: Engine, tables) -> None:
    """Bring tables made by an older version up to date: `create_all` creates missing tables but
    never a missing column or index of an existing one. Columns are added as nullable.
    Idempotent; another process making the same change at the same moment is fine."""
    quote = engine.dialect.identifier_preparer.quote
    for table in tables:
        columns, indexes = _names(engine, table.name, "columns"), _names(engine, table.name, "indexes")
        for column in table.columns:
            if column.name not in columns:
                _change(engine, text(f"ALTER TABLE {quote(table.name)} ADD COLUMN {quote(column.name)} "
                                     f"{column.type.compile(engine.dialect)}"),
                        lambda: column.name in _names(engine, table.name, "columns"))
        for index in table.indexes:
            if index.name not in indexes:
                _change(engine, CreateIndex(index), lambda: index.name in _names(engine, table.name, "indexes"))


def _names(engine: Engine, table: str, kind: str) -> set[str]:
    """The names of a table's columns or indexes, as the database has them now."""
    found = inspect(engine).get_columns(table) if kind == "columns" else inspect(engine).get_indexes(table)
    return {item["name"] for item in found}


def _change(engine: Engine, ddl, done) -> None:
    """One schema change; when it fails because another process made it first, `done()` says so."""
    try:
        with engine.begin() as conn:
            conn.execute(ddl)
        log.info("database: %s", ddl)
    except DBAPIError:
        if not done():
            raise
