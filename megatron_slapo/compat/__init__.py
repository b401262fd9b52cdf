"""Every use of a third-party private name or patch, in one place."""
