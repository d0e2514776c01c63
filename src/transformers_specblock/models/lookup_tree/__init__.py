from .configuration_lookup_tree import LookupTreeConfig
from .modeling_lookup_tree import LookupTreeModel

__all__ = ["LookupTreeConfig", "LookupTreeModel"]
