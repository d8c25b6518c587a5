"""The NVMe tier: swap files and their read / update / write pipeline (`swapper`), and the
per-layer-group state the engine keeps in them (`tier`)."""
