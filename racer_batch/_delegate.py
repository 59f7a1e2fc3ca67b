"""``delegated``: a read-only property that reads an attribute of the object, or of an object it holds."""

from __future__ import annotations

from operator import attrgetter


def delegated(path: str, doc: str | None = None) -> property:
    """A read-only property returning ``self.<path>``; ``path`` may be dotted (``"kv_cache.max_len"``).

    The getter is ``operator.attrgetter`` (C code): a read costs no Python frame, less than a ``def`` property."""
    return property(attrgetter(path), doc=doc)
