"""Reading checkpoints written by orbax-checkpoint (README.md, docs/ORBAX.md)."""
