"""Worker: orbax-checkpoint itself saves a Flax TrainState (AdamW) from a multi-process job.

usage: orbax_save.py DIR     (2 processes x 4 devices, mesh (2, 4); default options: OCDBT
                              with a database per process, merged at the end)
"""

import sys

import multiproc

multiproc.init()

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import orbax_states  # noqa: E402

mesh = jax.make_mesh((2, 4), ("data", "model"))
ckptr = ocp.StandardCheckpointer()
ckptr.save(sys.argv[1], orbax_states.train_state(mesh))
ckptr.wait_until_finished()
print("ok", jax.process_index(), flush=True)
