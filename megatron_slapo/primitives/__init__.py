"""Schedule primitives, one family per module; each is a typed method of ``Schedule``."""
