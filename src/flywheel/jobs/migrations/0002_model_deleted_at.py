"""a fine-tuned model can be deleted: ft_jobs.model_deleted_at

Revision ID: 0002
Revises: 0001
"""

from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('ft_jobs', sa.Column('model_deleted_at', sa.DateTime(), nullable=True))


def downgrade() -> None:
    op.drop_column('ft_jobs', 'model_deleted_at')
