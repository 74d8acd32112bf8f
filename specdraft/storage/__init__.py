"""The bottom of the layers, beside errors.py: where caches live (`cache_root`) and how a
file or folder is written whole or not at all (`atomic_files`). Imports nothing of
specdraft's but errors."""
