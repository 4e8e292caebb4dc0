"""Schema migrations of the state store (alembic): a server upgraded in place keeps its rows.

Contract:
- ``upgrade(engine)`` brings the store to ``HEAD``, in one transaction; idempotent. On
  PostgreSQL it holds an advisory lock while it runs, so two servers starting together on one
  database migrate it once. A store an older server made before migrations existed (tables,
  no ``alembic_version``) is stamped ``0001`` first; the revisions after it add only the
  columns it lacks (``add_column_once``), which is what that older server's start did.
- ``revision(engine)``: the revision the store is at (None: empty, or unversioned).
- A schema change is a new file in ``versions/`` (``alembic revision`` with this folder as
  ``script_location``, or by hand); ``tests/unit/test_migrations.py`` fails while the models
  in ``store.py`` and the migrated schema differ.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command, op
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Engine

__all__ = ["HEAD", "upgrade", "revision", "add_column_once"]

HEAD = "0011"
_FIRST = "0001"
_LOCK_KEY = 0x7472656C6179  # "trelay": the advisory lock two starting servers share


def _config(conn: Any) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent))
    cfg.attributes["connection"] = conn
    return cfg


def upgrade(engine: Engine) -> None:
    """Migrate the store to ``HEAD`` (see the module docstring). Raises what the driver raises."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
        cfg = _config(conn)
        inspector = sa.inspect(conn)
        if not inspector.has_table("alembic_version") and inspector.has_table("jobs"):
            command.stamp(cfg, _FIRST)
        command.upgrade(cfg, "head")


def revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def add_column_once(table: str, column: sa.Column, backfill: str | None = None) -> None:
    """In a revision: add ``column`` unless ``table`` has it (a store an older server made
    added it at its start), then fill it in with ``backfill`` (SQL) where NULL would lose what
    older rows knew."""
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
    if column.name in present:
        return
    op.add_column(table, column)
    if backfill:
        op.execute(backfill)
