"""The execution engine: stage, checksum, write and commit; read, verify and place."""
