"""A tiny Llama GGUF file written with ``gguf.GGUFWriter`` (random weights, byte-level tokens), and
where its tensor table entries lie, for the tests that damage it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

D_MODEL, HEADS, KV_HEADS, D_FF = 32, 4, 2, 64
TEMPLATE = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"


def _byte_tokens() -> list[str]:
    """GPT-2's 256 byte-level token spellings, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spellings, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spellings[byte] = chr(byte)
        else:
            spellings[byte] = chr(256 + extra)
            extra += 1
    return [spellings[b] for b in range(256)]


def write_tiny_gguf(path: Path, **changes: Any) -> Path:
    """A 1-layer Llama GGUF at ``path``; ``changes`` replace metadata values by name
    (``rope_base``, ``rms_eps``, ``context``, ``eos``, ``template``)."""
    settings = {"rope_base": 10000.0, "rms_eps": 1e-5, "context": 64, "eos": 257, "template": TEMPLATE} | changes
    rng = np.random.default_rng(0)
    tokens = [*_byte_tokens(), "<|im_start|>", "<|im_end|>", "Ġt", "he"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(settings["context"])
    writer.add_embedding_length(D_MODEL)
    writer.add_feed_forward_length(D_FF)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(settings["rope_base"])
    writer.add_layer_norm_rms_eps(settings["rms_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3, 1, 1])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(settings["eos"])
    writer.add_chat_template(settings["template"])
    kv = D_MODEL // HEADS * KV_HEADS

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(len(tokens), D_MODEL))
    writer.add_tensor("output_norm.weight", 1 + weight(D_MODEL))
    block = {
        "attn_norm.weight": 1 + weight(D_MODEL),
        "attn_q.weight": weight(D_MODEL, D_MODEL),
        "attn_k.weight": weight(kv, D_MODEL),
        "attn_v.weight": weight(kv, D_MODEL),
        "attn_output.weight": weight(D_MODEL, D_MODEL),
        "ffn_norm.weight": 1 + weight(D_MODEL),
        "ffn_gate.weight": weight(D_FF, D_MODEL),
        "ffn_up.weight": weight(D_FF, D_MODEL),
    }
    for name, values in block.items():
        writer.add_tensor(f"blk.0.{name}", values)
    down = weight(D_MODEL, D_FF)  # quantized, as most weights of a real file are
    writer.add_tensor(
        "blk.0.ffn_down.weight",
        quants.quantize(down, GGMLQuantizationType.Q4_1),
        raw_dtype=GGMLQuantizationType.Q4_1,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_entry(path: Path, name: str) -> tuple[int, int]:
    """(byte position of the type, of the offset) of tensor ``name``'s entry in the tensor table."""
    data = path.read_bytes()
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * dims
    return type_at, type_at + 4


def data_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s bytes start in the file."""
    from gguf import GGUFReader

    return next(int(t.data_offset) for t in GGUFReader(str(path)).tensors if t.name == name)
