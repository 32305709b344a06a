"""registry_pruned: the rejected versions whose model files were removed

A registry of schema version 1 made before this table existed lacks it; one made after has it
already (the first release created missing tables on open). Either way it exists after this.

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
    if "registry_pruned" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table('registry_pruned',
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('bytes', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['version'], ['registry_versions.id'], ),
    sa.PrimaryKeyConstraint('version')
    )


def downgrade() -> None:
    op.drop_table('registry_pruned')
