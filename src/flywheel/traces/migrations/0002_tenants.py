"""every trace and its feedback owned by a tenant; idempotency keys unique per tenant

Traces stored before tenants belong to the tenant "default", a single-tenant server's. The
first schema's unique constraints on idempotency_key alone were unnamed: PostgreSQL named them
`<table>_idempotency_key_key`; on SQLite they are dropped by recreating the table, with the
naming convention below giving the reflected constraint a name (flywheel.migrations runs
SQLite migrations with foreign keys off, so recreating `traces` leaves its feedback alone).

Revision ID: 0002
Revises: 0001
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

CONVENTION = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _unnamed_unique(table: str) -> str:
    if op.get_bind().dialect.name == "postgresql":
        return f"{table}_idempotency_key_key"
    return f"uq_{table}_idempotency_key"


def upgrade() -> None:
    for table in ("traces", "trace_feedback"):
        with op.batch_alter_table(table, naming_convention=CONVENTION) as batch:
            batch.add_column(sa.Column('tenant', sa.String(length=200), server_default='default', nullable=False))
            batch.drop_constraint(_unnamed_unique(table), type_='unique')
            batch.create_unique_constraint(f'uq_{table}_tenant_idempotency_key', ['tenant', 'idempotency_key'])
    op.create_index(op.f('ix_traces_tenant'), 'traces', ['tenant'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_traces_tenant'), table_name='traces')
    for table in ("traces", "trace_feedback"):
        with op.batch_alter_table(table, naming_convention=CONVENTION) as batch:
            batch.drop_constraint(f'uq_{table}_tenant_idempotency_key', type_='unique')
            batch.drop_column('tenant')
            batch.create_unique_constraint(_unnamed_unique(table), ['idempotency_key'])
