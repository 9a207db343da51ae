"""Elastic federation groups (--fl-elastic): each federation group its own job, the inter-group
tier torchft's managed process group over the live groups. Imports torchft."""

from .groups import ElasticProcessGroups, build_elastic_process_groups, join_tier
from .peer_tier import ElasticPeerTier
from .quorum_group import registered_quorum_group, unregister_quorum_group
from .signature import federation_signature

__all__ = ["ElasticPeerTier", "ElasticProcessGroups", "build_elastic_process_groups", "federation_signature",
           "join_tier", "registered_quorum_group", "unregister_quorum_group"]
