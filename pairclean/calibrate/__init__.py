"""Known noise injected into a user's own dataset, to calibrate on it: `pairclean corrupt` (captions
shuffled, hard, weak or mixed: `corrupt.py`) and `corrupt --mode duplicate` (planted copies:
`duplicates.py`), each writing the copy and a truth file that `evaluate` measures against."""
