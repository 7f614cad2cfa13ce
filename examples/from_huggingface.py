"""Hugging Face weights in and out of a sharded Flax model: a Llama-style decoder.

    python examples/from_huggingface.py

Writes a tiny Llama-style model's weights in the HF layout (two ``.safetensors`` files and
``model.safetensors.index.json``, tensor names as ``transformers`` gives them) with random
values, using the ``safetensors`` package as a stand-in for a downloaded model; loads them
into a scanned Flax decoder sharded on a (4, 2) ('data', 'model') mesh with
``jaxckpt.safetensors.load``; runs a forward pass; saves them back in the HF layout and
checks that the files read back equal to the originals. ``LLAMA_NAMES`` and
``llama_transforms`` are the whole mapping for this architecture.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt.safetensors import Reshape, Stack, Transpose  # noqa: E402

# leaf path (keys joined by ".") -> HF tensor name; "{i}" is the layer of a scanned leaf
LLAMA_NAMES = [
    (r"^embed\.embedding$", "model.embed_tokens.weight"),
    (r"^layers\.attn\.(q|k|v|o)\.kernel$", r"model.layers.{i}.self_attn.\1_proj.weight"),
    (r"^layers\.mlp\.(gate|up|down)\.kernel$", r"model.layers.{i}.mlp.\1_proj.weight"),
    (r"^layers\.input_norm\.scale$", "model.layers.{i}.input_layernorm.weight"),
    (r"^layers\.post_norm\.scale$", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"^norm\.scale$", "model.norm.weight"),
    (r"^lm_head\.kernel$", "lm_head.weight"),
]


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 64
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 8
    ffn: int = 128
    layers: int = 2


def llama_transforms(c: Config) -> list:
    """HF ``nn.Linear`` weights are ``(out, in)``; the Flax kernels are ``(in, ...)`` with
    attention heads as their own axes, and layers stacked on a leading axis."""
    d, h, kv, hd = c.dim, c.heads, c.kv_heads, c.head_dim
    return [
        (r"attn\.q\.", [Stack(), Reshape((h * hd, d), (h, hd, d)), Transpose((2, 0, 1))]),
        (r"attn\.(k|v)\.", [Stack(), Reshape((kv * hd, d), (kv, hd, d)), Transpose((2, 0, 1))]),
        (r"attn\.o\.", [Stack(), Reshape((d, h * hd), (d, h, hd)), Transpose((1, 2, 0))]),
        (r"mlp\.", [Stack(), Transpose((1, 0))]),
        (r"^layers\.", [Stack()]),
        (r"^lm_head\.", [Transpose((1, 0))]),
    ]


def hf_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """The tensors of a Llama checkpoint as ``transformers`` names and shapes them."""
    shapes = {
        "model.embed_tokens.weight": (c.vocab, c.dim),
        "model.norm.weight": (c.dim,),
        "lm_head.weight": (c.vocab, c.dim),
    }
    for i in range(c.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (c.heads * c.head_dim, c.dim),
            p + "self_attn.k_proj.weight": (c.kv_heads * c.head_dim, c.dim),
            p + "self_attn.v_proj.weight": (c.kv_heads * c.head_dim, c.dim),
            p + "self_attn.o_proj.weight": (c.dim, c.heads * c.head_dim),
            p + "mlp.gate_proj.weight": (c.ffn, c.dim),
            p + "mlp.up_proj.weight": (c.ffn, c.dim),
            p + "mlp.down_proj.weight": (c.dim, c.ffn),
            p + "input_layernorm.weight": (c.dim,),
            p + "post_attention_layernorm.weight": (c.dim,),
        }
    return shapes


def write_hf_model(directory: str, c: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random bf16 weights in the HF sharded layout, written by the ``safetensors`` package."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {
        name: (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
        for name, shape in hf_shapes(c).items()
    }
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(directory, fname), {"format": "pt"})
        weight_map |= {n: fname for n in part}
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return tensors


def abstract_params(c: Config, mesh) -> dict:
    """The Flax decoder's parameters as ShapeDtypeStructs on ``mesh`` (tensor parallel over
    'model': heads and the FFN; everything else replicated)."""

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    L, d, h, kv, hd, f = c.layers, c.dim, c.heads, c.kv_heads, c.head_dim, c.ffn
    return {
        "embed": {"embedding": sds((c.vocab, d), P(None, "model"))},
        "layers": {
            "attn": {
                "q": {"kernel": sds((L, d, h, hd), P(None, None, "model"))},
                "k": {"kernel": sds((L, d, kv, hd), P(None, None, "model"))},
                "v": {"kernel": sds((L, d, kv, hd), P(None, None, "model"))},
                "o": {"kernel": sds((L, h, hd, d), P(None, "model"))},
            },
            "mlp": {
                "gate": {"kernel": sds((L, d, f), P(None, None, "model"))},
                "up": {"kernel": sds((L, d, f), P(None, None, "model"))},
                "down": {"kernel": sds((L, f, d), P(None, "model"))},
            },
            "input_norm": {"scale": sds((L, d), P())},
            "post_norm": {"scale": sds((L, d), P())},
        },
        "norm": {"scale": sds((d,), P())},
        "lm_head": {"kernel": sds((d, c.vocab), P(None, "model"))},
    }


def forward(params, tokens, c: Config):
    """A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU), layers scanned."""

    def rms(x, scale):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * scale).astype(
            x.dtype
        )

    x = params["embed"]["embedding"][tokens]
    mask = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))

    def layer(x, p):
        a = p["attn"]
        y = rms(x, p["input_norm"]["scale"])
        q = jnp.einsum("btd,dhk->bthk", y, a["q"]["kernel"])
        k = jnp.einsum("btd,dhk->bthk", y, a["k"]["kernel"])
        v = jnp.einsum("btd,dhk->bthk", y, a["v"]["kernel"])
        rep = c.heads // c.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(c.head_dim)
        w = jax.nn.softmax(jnp.where(mask, s, -1e9).astype(jnp.float32), -1).astype(x.dtype)
        x = x + jnp.einsum("bhqs,bshk,hkd->bqd", w, v, a["o"]["kernel"])
        m = p["mlp"]
        y = rms(x, p["post_norm"]["scale"])
        gated = jax.nn.silu(y @ m["gate"]["kernel"]) * (y @ m["up"]["kernel"])
        return x + gated @ m["down"]["kernel"], None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return rms(x, params["norm"]["scale"]) @ params["lm_head"]["kernel"]


def main() -> None:
    from safetensors.numpy import load_file

    c = Config()
    auto = (jax.sharding.AxisType.Auto,) * 2  # let XLA place the forward pass's intermediates
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    with tempfile.TemporaryDirectory() as root:
        hf = os.path.join(root, "hf")
        os.makedirs(hf)
        original = write_hf_model(hf, c)
        transforms = llama_transforms(c)
        params = jaxckpt.safetensors.load(
            hf, abstract_params(c, mesh), names=LLAMA_NAMES, transforms=transforms
        )
        tokens = jax.device_put(
            np.arange(4 * 8).reshape(4, 8) % c.vocab, NamedSharding(mesh, P("data"))
        )
        logits = jax.jit(forward, static_argnums=2)(params, tokens, c)
        print("logits", logits.shape, logits.dtype, "finite:", bool(jnp.isfinite(logits).all()))
        out = os.path.join(root, "hf_again")
        jaxckpt.safetensors.save(
            out, params, names=LLAMA_NAMES, transforms=transforms, max_file_bytes=100_000
        )
        again = {}
        for name in sorted(os.listdir(out)):
            if name.endswith(".safetensors"):
                again |= load_file(os.path.join(out, name))
        same = again.keys() == original.keys() and all(
            again[k].tobytes() == original[k].tobytes() for k in original
        )
        print(f"saved back as {sorted(os.listdir(out))}; equal to the original: {same}")
        assert same


if __name__ == "__main__":
    main()
