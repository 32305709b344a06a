"""the trace store's first schema: traces and their feedback (what flywheel_meta called version 1)

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
    op.create_table('traces',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('source', sa.String(length=200), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=True),
    sa.Column('model_version', sa.String(length=200), nullable=True),
    sa.Column('messages', JSON, nullable=False),
    sa.Column('tools', JSON, nullable=True),
    sa.Column('response', JSON, nullable=True),
    sa.Column('usage', JSON, nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.Column('latency_ms', sa.Float(), nullable=True),
    sa.Column('metadata', JSON, nullable=True),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('idempotency_key')
    )
    op.create_index(op.f('ix_traces_created_at'), 'traces', ['created_at'], unique=False)
    op.create_index(op.f('ix_traces_source'), 'traces', ['source'], unique=False)
    op.create_table('trace_feedback',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('trace_id', sa.String(length=128), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('label', sa.String(length=200), nullable=True),
    sa.Column('correction', JSON, nullable=True),
    sa.Column('text', sa.Text(), nullable=True),
    sa.Column('verifier_env', sa.String(length=200), nullable=True),
    sa.Column('verifier_task', JSON, nullable=True),
    sa.ForeignKeyConstraint(['trace_id'], ['traces.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('idempotency_key')
    )
    op.create_index(op.f('ix_trace_feedback_label'), 'trace_feedback', ['label'], unique=False)
    op.create_index(op.f('ix_trace_feedback_trace_id'), 'trace_feedback', ['trace_id'], unique=False)
    op.create_index(op.f('ix_trace_feedback_verifier_env'), 'trace_feedback', ['verifier_env'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_trace_feedback_verifier_env'), table_name='trace_feedback')
    op.drop_index(op.f('ix_trace_feedback_trace_id'), table_name='trace_feedback')
    op.drop_index(op.f('ix_trace_feedback_label'), table_name='trace_feedback')
    op.drop_table('trace_feedback')
    op.drop_index(op.f('ix_traces_source'), table_name='traces')
    op.drop_index(op.f('ix_traces_created_at'), table_name='traces')
    op.drop_table('traces')
