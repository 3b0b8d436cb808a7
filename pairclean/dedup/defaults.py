"""What the command line names without starting the run (torch, faiss): the demo fixes torch's CPU
arithmetic before torch starts, so `pairclean dedup --help` must not import it."""

DEFAULT_THRESHOLD = 0.95  # cosine; SemDeDup's eps = 1 - threshold (docs/dedup.md: the sweep behind it)
