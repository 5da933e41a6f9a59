"""The database engine: a SQLite file in the user data dir by default, any SQLAlchemy URL allowed."""
from __future__ import annotations

import importlib
import logging
import os
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


def private_sqlite_file(path: Path) -> None:
    """The database holds run specs with their env values (tokens, keys): owner-only. SQLite gives
    its -wal, -shm and -journal files the database file's mode, so the file is created 0600 before
    SQLite opens it; one left more open (by an older version) is tightened, with its companions."""
    private_dir(path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask
        os.close(fd)
    except FileExistsError:
        pass
    for name in (path, *(Path(f"{path}{suffix}") for suffix in ("-wal", "-shm", "-journal"))):
        try:
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot make %s private (chmod 600 it yourself): %s", name, exc)


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
    SQLModel.metadata.create_all(engine)
    upgrade_tables(engine, SQLModel.metadata.sorted_tables)


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
