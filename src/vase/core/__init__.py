"""The pure core: methods (policies), the eviction kernel, the ring, the schedule, the request spec and its
checks and errors, the engines' capability table. Imports nothing of vase above it (torch only)."""
