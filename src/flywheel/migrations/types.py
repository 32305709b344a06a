"""Column types as the first revisions wrote them, frozen here for every store's scripts: a
later change to `flywheel.database.json_column()` must not change what an old revision builds."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

JSON_V1 = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
