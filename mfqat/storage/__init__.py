"""Storage: how mfqat's artifacts reach the disk and are read back safely.

Owns: ``io`` (atomic files and folders, sha256), ``guard`` (one writer per path, leftovers of killed
writers), ``manifest`` (hashes of every file plus a digest of the metadata; ``AnchorError``),
``shard_files`` (the HF safetensors shard layout), ``sharded`` (tied aliases and FSDP2's gathered state
dict), ``model_card`` (README.md of what mfqat writes).

May import: formats, progress. Nothing here knows a quantization format or a model family.
Importing this package imports nothing heavy (the CLI uses ``guard`` before torch loads).
"""
