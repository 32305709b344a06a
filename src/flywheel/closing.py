"""`Closing`: an object with a `close()` is a context manager that closes on exit."""

from __future__ import annotations

from typing import Self


class Closing:
    """Mixin: `with X(...) as x:` returns x and calls `x.close()` however the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
