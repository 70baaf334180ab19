__version__ = "0.1.0"

#: The ``dist_checkpointing`` backend name and format version written to ``metadata.json``.
BACKEND = "bcp"
VERSION = 1
