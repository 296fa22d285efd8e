"""liubai's memory: every conversation kept inside its KV budget, and nothing it said lost.

``ContextManager`` builds each prompt within the session's budget, compacting old turns into a
model-written summary and recalling evicted ones by full-text search; ``Store`` keeps every
message, summary, compaction and request in SQLite.
"""

from memory.budget import Budget, BudgetSpec
from memory.compaction import CompactionEvent
from memory.context_manager import ContextManager
from memory.errors import BudgetError, MemoryLayerError, SessionNotFoundError, StoreError
from memory.prompt_layout import BuiltPrompt
from memory.records import MessageRecord, SearchHit, SessionRecord
from memory.store import Store, default_db_path
from memory.turn_map import TurnInfo

__all__ = [
    "Budget",
    "BudgetError",
    "BudgetSpec",
    "BuiltPrompt",
    "CompactionEvent",
    "ContextManager",
    "MemoryLayerError",
    "MessageRecord",
    "SearchHit",
    "SessionNotFoundError",
    "SessionRecord",
    "Store",
    "StoreError",
    "TurnInfo",
    "default_db_path",
]
