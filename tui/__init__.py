"""pask_local.tui: a Textual app to inspect which tokens are retained in which layer group."""
