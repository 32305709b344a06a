"""managed flywheels and their cycles; a job's training_file may be null (a cycle's)

Revision ID: 0004
Revises: 0003
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

# flywheel.database.json_column() as it was when this migration was written: JSONB on PostgreSQL
JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('ft_jobs') as batch:
        batch.alter_column('training_file', existing_type=sa.String(length=64), nullable=True)
    op.create_table('ft_flywheels',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('model', sa.String(length=400), nullable=False),
    sa.Column('suffix', sa.String(length=64), nullable=False),
    sa.Column('alias', sa.String(length=500), nullable=False),
    sa.Column('spec', JSON, nullable=False),
    sa.Column('data_dir', sa.Text(), nullable=False),
    sa.Column('traces_url', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('production_model', sa.String(length=400), nullable=False),
    sa.Column('production_version', sa.String(length=32), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.Column('cursor', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('metadata', JSON, nullable=True),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('alias'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('tenant', 'idempotency_key')
    )
    op.create_index(op.f('ix_ft_flywheels_tenant'), 'ft_flywheels', ['tenant'], unique=False)
    op.create_table('ft_flywheel_cycles',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('flywheel_id', sa.String(length=64), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('outcome', sa.String(length=64), nullable=True),
    sa.Column('decision', JSON, nullable=True),
    sa.Column('scores', JSON, nullable=True),
    sa.Column('new_failures', sa.Integer(), nullable=True),
    sa.Column('trace_cursor', sa.Integer(), nullable=True),
    sa.Column('usd', sa.Double(), nullable=True),
    sa.Column('version', sa.String(length=32), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.ForeignKeyConstraint(['flywheel_id'], ['ft_flywheels.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['ft_jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('flywheel_id', 'number'),
    sa.UniqueConstraint('id')
    )
    op.create_index(op.f('ix_ft_flywheel_cycles_flywheel_id'), 'ft_flywheel_cycles', ['flywheel_id'], unique=False)
    op.create_index(op.f('ix_ft_flywheel_cycles_job_id'), 'ft_flywheel_cycles', ['job_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_ft_flywheel_cycles_job_id'), table_name='ft_flywheel_cycles')
    op.drop_index(op.f('ix_ft_flywheel_cycles_flywheel_id'), table_name='ft_flywheel_cycles')
    op.drop_table('ft_flywheel_cycles')
    op.drop_index(op.f('ix_ft_flywheels_tenant'), table_name='ft_flywheels')
    op.drop_table('ft_flywheels')
    with op.batch_alter_table('ft_jobs') as batch:
        batch.alter_column('training_file', existing_type=sa.String(length=64), nullable=False)
