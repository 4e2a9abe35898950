"""Files vase writes and reads: atomic writes, text files, run provenance."""
