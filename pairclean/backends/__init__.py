"""Encoder backends: the frozen estimators (and trainable targets) behind one protocol."""
