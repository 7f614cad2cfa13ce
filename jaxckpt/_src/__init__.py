"""jaxckpt's implementation. Nothing here is public: import from ``jaxckpt``,
``jaxckpt.errors``, ``jaxckpt.export`` or ``jaxckpt.safetensors``."""
