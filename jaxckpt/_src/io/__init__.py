"""The storage engine: reads and writes of a checkpoint's bytes, jax-free (README.md)."""
