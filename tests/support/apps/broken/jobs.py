"""An app's jobs module with a bug of its own (not a missing dependency)."""

raise RuntimeError("this jobs module is broken")
