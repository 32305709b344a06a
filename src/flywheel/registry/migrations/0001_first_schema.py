"""the registry's first schema: versions, the production marker (its one row), history

What flywheel_meta called registry version 1, less registry_pruned, which some such
registries lack (0002 adds it where missing).

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
    op.create_table('registry_versions',
    sa.Column('seq', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('storage', sa.String(length=16), nullable=False),
    sa.Column('parent', sa.String(length=64), nullable=True),
    sa.Column('cycle', sa.String(length=200), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reasons', JSON, nullable=False),
    sa.Column('data_counts', JSON, nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('eval_scores', JSON, nullable=False),
    sa.Column('cost', JSON, nullable=False),
    sa.Column('files', JSON, nullable=False),
    sa.Column('notes', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['parent'], ['registry_versions.id'], ),
    sa.PrimaryKeyConstraint('seq'),
    sa.UniqueConstraint('id'),
    sa.UniqueConstraint('key')
    )
    op.create_index(op.f('ix_registry_versions_cycle'), 'registry_versions', ['cycle'], unique=False)
    op.create_index(op.f('ix_registry_versions_parent'), 'registry_versions', ['parent'], unique=False)
    op.create_index(op.f('ix_registry_versions_status'), 'registry_versions', ['status'], unique=False)
    op.create_index('registry_one_production', 'registry_versions', ['status'], unique=True, sqlite_where=sa.text("status = 'production'"), postgresql_where=sa.text("status = 'production'"))
    op.create_table('registry_history',
    sa.Column('seq', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('version', sa.String(length=64), nullable=False),
    sa.Column('previous', sa.String(length=64), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['previous'], ['registry_versions.id'], ),
    sa.ForeignKeyConstraint(['version'], ['registry_versions.id'], ),
    sa.PrimaryKeyConstraint('seq')
    )
    op.create_index(op.f('ix_registry_history_version'), 'registry_history', ['version'], unique=False)
    op.create_table('registry_state',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('production', sa.String(length=64), nullable=True),
    sa.Column('generation', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['production'], ['registry_versions.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    op.bulk_insert(sa.table('registry_state', sa.column('id', sa.Integer()), sa.column('production', sa.String()),
                            sa.column('generation', sa.Integer())), [{"id": 1, "production": None, "generation": 0}])


def downgrade() -> None:
    op.drop_table('registry_state')
    op.drop_index(op.f('ix_registry_history_version'), table_name='registry_history')
    op.drop_table('registry_history')
    op.drop_index('registry_one_production', table_name='registry_versions', sqlite_where=sa.text("status = 'production'"), postgresql_where=sa.text("status = 'production'"))
    op.drop_index(op.f('ix_registry_versions_status'), table_name='registry_versions')
    op.drop_index(op.f('ix_registry_versions_parent'), table_name='registry_versions')
    op.drop_index(op.f('ix_registry_versions_cycle'), table_name='registry_versions')
    op.drop_table('registry_versions')
