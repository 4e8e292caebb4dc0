"""users, tokens and auth_keys: who may call the server (``torchrelay/server/auth.py``).

Revision ID: 0009
Revises: 0008
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("user_name", sa.String(128), nullable=True),
        sa.Column("node_id", sa.String(64), nullable=True),
        sa.Column("label", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=True),
        sa.Column("revoked_at", sa.Float, nullable=True),
    )
    op.create_index("ix_tokens_user_name", "tokens", ["user_name"])
    op.create_table(
        "auth_keys",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("secret", sa.String(128), nullable=False),
    )
