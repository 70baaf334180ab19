"""The representation shared by every layer: boxes, shard descriptions, the manifest and the safe
value encoding. Imports nothing else of bcp but its errors and its wire records."""

from bcp.layout.box import Box, flat_range_to_boxes
from bcp.layout.manifest import FORMAT_VERSION, Manifest, ObjectEntry, ShardEntry, TensorEntry
from bcp.layout.shards import FlatShard, TensorShard

__all__ = [
    "Box", "flat_range_to_boxes", "FORMAT_VERSION", "Manifest", "ObjectEntry", "ShardEntry",
    "TensorEntry", "FlatShard", "TensorShard",
]
