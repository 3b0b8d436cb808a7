"""`pairclean bench`: what the scoring pipeline does with a model and without one, measured
(`score.py`), and the measuring tools it and the benchmarks under `benchmarks/` share (`measure.py`)."""
