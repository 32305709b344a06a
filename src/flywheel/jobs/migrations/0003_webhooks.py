"""webhook endpoints of tenants

Revision ID: 0003
Revises: 0002
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# flywheel.database.json_column() as it was when this migration was written: JSONB on PostgreSQL
JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('webhook_endpoints',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('secret', sa.String(length=100), nullable=False),
    sa.Column('events', JSON, nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_webhook_endpoints_tenant'), 'webhook_endpoints', ['tenant'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_webhook_endpoints_tenant'), table_name='webhook_endpoints')
    op.drop_table('webhook_endpoints')
