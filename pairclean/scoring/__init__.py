"""The scoring run: producers of similarities -> parts -> finalize into one scores file."""
