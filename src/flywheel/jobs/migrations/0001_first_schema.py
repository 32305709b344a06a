"""the job store's first schema: files, jobs, events, checkpoints, api keys

Revision ID: 0001
Revises: 
"""

from alembic import op
import sqlalchemy as sa

from flywheel.migrations.types import JSON_V1 as JSON  # json_column() as it was: JSONB on PostgreSQL

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=8), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('revoked_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('sha256')
    )
    op.create_index(op.f('ix_api_keys_tenant'), 'api_keys', ['tenant'], unique=False)
    op.create_table('ft_files',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('purpose', sa.String(length=50), nullable=False),
    sa.Column('filename', sa.String(length=500), nullable=False),
    sa.Column('bytes', sa.Integer(), nullable=False),
    sa.Column('lines', sa.Integer(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('tenant', 'idempotency_key')
    )
    op.create_index(op.f('ix_ft_files_tenant'), 'ft_files', ['tenant'], unique=False)
    op.create_table('ft_jobs',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=200), nullable=False),
    sa.Column('model', sa.String(length=300), nullable=False),
    sa.Column('method', JSON, nullable=False),
    sa.Column('training_file', sa.String(length=64), nullable=False),
    sa.Column('validation_file', sa.String(length=64), nullable=True),
    sa.Column('suffix', sa.String(length=64), nullable=True),
    sa.Column('seed', sa.Integer(), nullable=False),
    sa.Column('metadata', JSON, nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('fine_tuned_model', sa.String(length=400), nullable=True),
    sa.Column('model_path', sa.Text(), nullable=True),
    sa.Column('error', JSON, nullable=True),
    sa.Column('trained_tokens', sa.Integer(), nullable=True),
    sa.Column('estimated_cost', sa.Double(), nullable=True),
    sa.Column('control', sa.String(length=16), nullable=True),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('lease_until', sa.DateTime(), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('fine_tuned_model'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('tenant', 'idempotency_key')
    )
    op.create_index('ft_jobs_queue', 'ft_jobs', ['status', 'seq'], unique=False)
    op.create_index(op.f('ix_ft_jobs_tenant'), 'ft_jobs', ['tenant'], unique=False)
    op.create_table('ft_checkpoints',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('metrics', JSON, nullable=False),
    sa.Column('fine_tuned_model_checkpoint', sa.String(length=400), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['ft_jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('fine_tuned_model_checkpoint'),
    sa.UniqueConstraint('id')
    )
    op.create_index(op.f('ix_ft_checkpoints_job_id'), 'ft_checkpoints', ['job_id'], unique=False)
    op.create_table('ft_events',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('job_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('level', sa.String(length=10), nullable=False),
    sa.Column('type', sa.String(length=10), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', JSON, nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['ft_jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id')
    )
    op.create_index(op.f('ix_ft_events_job_id'), 'ft_events', ['job_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_ft_events_job_id'), table_name='ft_events')
    op.drop_table('ft_events')
    op.drop_index(op.f('ix_ft_checkpoints_job_id'), table_name='ft_checkpoints')
    op.drop_table('ft_checkpoints')
    op.drop_index(op.f('ix_ft_jobs_tenant'), table_name='ft_jobs')
    op.drop_index('ft_jobs_queue', table_name='ft_jobs')
    op.drop_table('ft_jobs')
    op.drop_index(op.f('ix_ft_files_tenant'), table_name='ft_files')
    op.drop_table('ft_files')
    op.drop_index(op.f('ix_api_keys_tenant'), table_name='api_keys')
    op.drop_table('api_keys')
