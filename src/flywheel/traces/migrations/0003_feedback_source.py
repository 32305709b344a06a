"""feedback names who gave it: "user" (clients) or "judge" (flywheel's judge model)

Every feedback row stored before this revision came from a client: it is "user".

Revision ID: 0003
Revises: 0002
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('trace_feedback', sa.Column('source', sa.String(length=20), server_default='user', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('trace_feedback') as batch:
        batch.drop_column('source')
