"""The database engine: a SQLite file in the user data dir by default, any SQLAlchemy URL allowed."""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import platformdirs
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.pool import StaticPool
from sqlmodel import SQLModel, create_engine

DB_URL_ENV = "SWIFT_STUDIO_DB"


def default_db_url() -> str:
    url = os.environ.get(DB_URL_ENV)
    if url:
        return url
    data = Path(platformdirs.user_data_dir("swift-studio"))
    data.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{data / 'studio.db'}"


def make_engine(url: str | None = None) -> Engine:
    url = url or default_db_url()
    if url.startswith("sqlite"):
        memory = url in ("sqlite://", "sqlite:///:memory:")
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
    importlib.import_module("backend.models")
    importlib.import_module("backend.telemetry_models")
    SQLModel.metadata.create_all(engine)
