"""Federation: process groups, the shard averaging and the engine that decides when to sync.

Needs torch.distributed; never imports a sharding backend (backends hand their local shards
to the engine through the small contract in `contract.py`).
"""

from .averaging import ShardAverager, SyncStats
from .chunks import Chunk, Segment, plan_chunks
from .contract import ShardOwner
from .engine import FederationEngine
from .groups import ProcessGroups, build_process_groups
from .ledger import CollectiveCounter, CommLedger
from .result import SyncResult
from .schedule import sync_due

__all__ = ["Chunk", "CollectiveCounter", "CommLedger", "FederationEngine", "ProcessGroups",
           "Segment", "ShardAverager", "ShardOwner", "SyncResult", "SyncStats",
           "build_process_groups", "plan_chunks", "sync_due"]
