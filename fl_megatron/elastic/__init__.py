"""Elastic federation groups (--fl-elastic, in progress): each federation group its own job, the
inter-group tier torchft's managed process group over the live groups. Imports torchft."""

from .peer_tier import ElasticPeerTier, Membership
from .quorum_group import registered_quorum_group, unregister_quorum_group

__all__ = ["ElasticPeerTier", "Membership", "registered_quorum_group", "unregister_quorum_group"]
