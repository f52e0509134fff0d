"""The bottom layer: errors, atomic file writes, the machine fingerprint and the one record contract.

Imports nothing else of xdeploy; every other package may import it."""
