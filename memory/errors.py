"""The memory layer's exceptions: one line each, turned into a message only at the edge."""


class MemoryLayerError(Exception):
    """Base class of every error ``memory/`` reports to a user."""


class StoreError(MemoryLayerError):
    """The database cannot be opened, read or written (locked, corrupt, newer, unwritable)."""


class SessionNotFoundError(StoreError):
    """No session with the given id is stored."""


class BudgetError(MemoryLayerError, ValueError):
    """A KV budget that cannot work: unparsable, or too small for what must stay in the prompt."""
