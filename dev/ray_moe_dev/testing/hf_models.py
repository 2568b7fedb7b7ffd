"""Tiny seeded transformers MoE models saved to a folder, for tests (nothing is downloaded).

    model, folder = tiny_model("deepseek_v3", tmp_path / "ds3", layout="fused", sharded=True)

Families (hidden 32, MoE ffn 48, 8 routed experts, top-2, vocab 128, 2-4 decoder layers); the layouts
below are what ``save_pretrained`` writes (``layout="per_expert"``):

    mixtral            2 layers, both MoE
    qwen2_moe          2 layers, both MoE, a gated shared expert, norm_topk_prob=False (weights do not sum to 1)
    qwen2_moe_step2    4 layers, decoder_sparse_step=2: MoE at decoder layers 1 and 3
    qwen3_moe          3 layers, all MoE
    qwen3_moe_dense0   3 layers, mlp_only_layers=[0]: MoE at decoder layers 1 and 2
    deepseek_v2        3 layers, first_k_dense_replace=1, group_limited_greedy (4 groups, 2 picked), 1 shared
    deepseek_v3        3 layers, first_k_dense_replace=1, sigmoid + correction bias, 4 groups / 2 picked,
                       routed_scaling_factor 2.5, 1 shared expert
    aria_text          2 layers, experts stored transposed (gate_up [E, d, 2f]); save_pretrained writes them
                       fused as mlp.experts.fc1 / fc2; softmax over the top-k logits; 1 shared expert
    granitemoe         2 layers; save_pretrained writes fused block_sparse_moe.input_linear / output_linear
                       and the router as block_sparse_moe.router.layer
    llama              a dense LlamaForCausalLM (no experts: for the unsupported-architecture error)

Layouts: ``per_expert`` is ``save_pretrained`` (Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen and
DeepSeek ``mlp.experts.{e}.gate_proj/up_proj/down_proj``; aria_text and granitemoe save fused tensors under
renamed names, see above); ``fused`` is the live state dict (``<experts>.gate_up_proj`` [E, 2f, d],
``<experts>.down_proj`` [E, d, f]; transposed for aria_text) plus config.json.
``sharded=True`` writes several files and ``model.safetensors.index.json``.
Weights use ``initializer_range=0.2`` so every MoE output is O(1).

``fp8_model(family, folder, block=(128, 128))`` writes a block-scaled FP8 copy (DeepSeek-V3 / Qwen3-FP8 layout:
e4m3 codes + ``*_scale_inv`` + ``quantization_config``) and returns transformers' load of its dequantized twin.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

HIDDEN, FFN, EXPERTS, TOP_K, VOCAB = 32, 48, 8, 2, 128

#: decoder layer index of each MoE layer, per family
MOE_LAYERS: dict[str, tuple[int, ...]] = {
    "mixtral": (0, 1),
    "qwen2_moe": (0, 1),
    "qwen2_moe_step2": (1, 3),
    "qwen3_moe": (0, 1, 2),
    "qwen3_moe_dense0": (1, 2),
    "deepseek_v2": (1, 2),
    "deepseek_v3": (1, 2),
    "aria_text": (0, 1),
    "granitemoe": (0, 1),
}
FAMILIES = tuple(MOE_LAYERS)
MODEL_TYPES = {"qwen2_moe_step2": "qwen2_moe", "qwen3_moe_dense0": "qwen3_moe"}


def tiny_config(family: str) -> Any:
    """The transformers config of a tiny model of ``family`` (see the module docstring)."""
    import transformers as tf

    common: dict[str, Any] = dict(hidden_size=HIDDEN, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=TOP_K)
    deepseek = dict(intermediate_size=64, moe_intermediate_size=FFN, n_routed_experts=EXPERTS, num_hidden_layers=3,
                    first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1, kv_lora_rank=16,
                    q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **moe,
                    **{**common, "num_key_value_heads": 4})  # MLA: one KV head per query head
    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=FFN, num_local_experts=EXPERTS, num_hidden_layers=2, **moe, **common)
    if family in ("qwen2_moe", "qwen2_moe_step2"):
        layers, step = (2, 1) if family == "qwen2_moe" else (4, 2)
        return tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=FFN, shared_expert_intermediate_size=FFN,
                                 num_experts=EXPERTS, num_hidden_layers=layers, decoder_sparse_step=step,
                                 norm_topk_prob=False, **moe, **common)
    if family in ("qwen3_moe", "qwen3_moe_dense0"):
        dense = [0] if family == "qwen3_moe_dense0" else []
        return tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=FFN, num_experts=EXPERTS,
                                 num_hidden_layers=3, mlp_only_layers=dense, head_dim=8, norm_topk_prob=True,
                                 **moe, **common)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(topk_method="group_limited_greedy", routed_scaling_factor=1.5, **deepseek)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **deepseek)
    if family == "aria_text":
        return tf.AriaTextConfig(intermediate_size=FFN, moe_num_experts=EXPERTS, moe_topk=TOP_K,
                                 moe_num_shared_experts=1, num_hidden_layers=2, **common)
    if family == "granitemoe":
        return tf.GraniteMoeConfig(intermediate_size=FFN, num_local_experts=EXPERTS, num_hidden_layers=2, **moe,
                                   **common)
    if family == "llama":
        return tf.LlamaConfig(intermediate_size=64, num_hidden_layers=2, **common)
    raise ValueError(f"family={family!r} is not one of {FAMILIES + ('llama',)}")


def build_model(family: str, *, seed: int = 0) -> Any:
    """A seeded tiny model of ``family`` in eval mode, float32."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if family == "deepseek_v3":  # a non-zero correction bias, so the bias path is exercised
        g = torch.Generator().manual_seed(seed + 1)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.1 * torch.randn(mod.e_score_correction_bias.shape, generator=g))
    return model


def save_fused(model: Any, folder: str, *, sharded: bool = False) -> None:
    """Write the live state dict (fused experts) and config.json; ``sharded``: 3 files and an index."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if not sharded:
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(state)
    parts = 3
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        part = keys[i::parts]
        save_file({k: state[k] for k in part}, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)


def tiny_model(family: str, folder: str | os.PathLike, *, layout: str = "per_expert", sharded: bool = False,
               seed: int = 0) -> tuple[Any, str]:
    """Build a seeded tiny model of ``family`` and save it to ``folder`` in ``layout``
    (``per_expert``: save_pretrained; ``fused``: live state dict). Returns (model, folder)."""
    folder = os.fspath(folder)
    model = build_model(family, seed=seed)
    if layout == "per_expert":
        kw = {"max_shard_size": "20KB"} if sharded else {}
        model.save_pretrained(folder, **kw)
    elif layout == "fused":
        save_fused(model, folder, sharded=sharded)
    else:
        raise ValueError(f"layout={layout!r} is not 'per_expert' or 'fused'")
    return model, folder


#: the quantization_config of a block-scaled FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8), for ``fp8_model``
def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict[str, Any]:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}


def _fp8_quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """The tensors an FP8 release quantizes: every decoder-layer Linear weight (attention projections, dense
    and shared-expert MLPs, routed experts per expert or fused), not norms, routers (``...gate.weight``: kept in
    high precision, as DeepSeek-V3 and Qwen3-FP8 ship them), embeddings or the LM head."""
    out = []
    for k, v in state.items():
        if ".layers." not in k or not v.is_floating_point() or k.endswith(".gate.weight"):
            continue
        if k.endswith(".weight") and v.dim() == 2:
            out.append(k)
        elif k.endswith((".gate_up_proj", ".down_proj")) and v.dim() == 3:  # fused experts [E, out, in]
            out.append(k)
    return out


def fp8_model(family: str, folder: str | os.PathLike, *, block: tuple[int, int] = (128, 128),
              layout: str = "per_expert", sharded: bool = False, seed: int = 0) -> tuple[Any, str]:
    """A block-scaled FP8 checkpoint of the tiny ``family`` model written to ``folder`` the way DeepSeek-V3 and
    Qwen3-FP8 ship: every decoder Linear weight W [out, in] as float8_e4m3fn codes plus ``<name>_scale_inv``
    [ceil(out/b0), ceil(in/b1)] float32 (scale = block amax / 448, ``ray_moe.moe.experts.fp8.quantize``),
    ``quantization_config`` in config.json. Fused experts (``layout="fused"``): ``gate_up_proj`` [E, 2f, d] with
    the gate's and the up's scale rows concatenated (each half quantized on its own, as transformers fuses
    per-expert FP8 weights), ``down_proj`` [E, d, f] per expert. ``sharded``: three files and an index (a
    tensor's scales mostly in another file than its codes).

    Also writes ``<folder>.dequantized``: the same checkpoint with every FP8 weight replaced by its value
    (code x scale, float32) and no quantization_config. Returns (transformers' own ``from_pretrained`` of that
    dequantized folder: the reference model, float32, eval mode; folder)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ray_moe.moe.experts.fp8 import dequantize, quantize

    folder = os.fspath(folder)
    plain, deq = folder + ".plain", folder + ".dequantized"
    tiny_model(family, plain, layout=layout, seed=seed)
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(plain)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(plain, name)))
    quant: dict[str, torch.Tensor] = dict(state)
    dense: dict[str, torch.Tensor] = dict(state)
    for k in _fp8_quantized_names(state):
        w = state[k]
        if k.endswith(".gate_up_proj"):
            f = w.shape[1] // 2
            halves = [quantize(w[:, :f], block), quantize(w[:, f:], block)]
            codes = torch.cat([halves[0][0], halves[1][0]], 1)
            scale = torch.cat([halves[0][1], halves[1][1]], 1)
            dense[k] = torch.cat([dequantize(c, s, block) for c, s in halves], 1)
        else:
            codes, scale = quantize(w, block)
            dense[k] = dequantize(codes, scale, block)
        quant[k], quant[k + "_scale_inv"] = codes.contiguous(), scale.contiguous()
    with open(os.path.join(plain, "config.json")) as fh:
        config = json.load(fh)
    for where, tensors, qc in ((folder, quant, fp8_quantization_config(block)), (deq, dense, None)):
        os.makedirs(where, exist_ok=True)
        _save_tensors(tensors, where, parts=3 if sharded and qc else 1)
        with open(os.path.join(where, "config.json"), "w") as fh:
            json.dump({**config, **({"quantization_config": qc} if qc else {})}, fh, indent=1)
        if os.path.exists(os.path.join(plain, "generation_config.json")):
            with open(os.path.join(plain, "generation_config.json")) as src, \
                    open(os.path.join(where, "generation_config.json"), "w") as dst:
                dst.write(src.read())
    model = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32, local_files_only=True)
    return model.eval(), folder


def _save_tensors(tensors: dict[str, torch.Tensor], folder: str, parts: int = 1) -> None:
    """``tensors`` as one ``model.safetensors`` or ``parts`` files (keys dealt round-robin) and an index."""
    from safetensors.torch import save_file

    if parts == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        save_file({k: tensors[k] for k in keys[i::parts]}, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys[i::parts]})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=1)


def live_experts(model: Any, moe_layer: int) -> Any:
    """The experts module of MoE layer ``moe_layer`` of a live model."""
    from ray_moe.model.seam import model_experts

    return model_experts(model)[moe_layer][1]


def live_expert_weights(model: Any, moe_layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate [f, d], w_up [f, d], w_down [d, f]) of one expert, straight from the model's parameters."""
    mod = live_experts(model, moe_layer)
    gu, dn = mod.gate_up_proj[expert].detach(), mod.down_proj[expert].detach()
    if getattr(mod, "is_transposed", False):
        gu, dn = gu.T, dn.T
    f = gu.shape[0] // 2
    return gu[:f], gu[f:], dn


def dense_modules_equal(host: Any, model: Any) -> int:
    """Assert every non-expert tensor ``host`` (a ``ModelHost``) holds equals ``model``'s, bit for bit (the routed
    experts live in a shard's slots: empty here); returns how many ``*proj.weight`` tensors were compared."""
    ours = host.model.state_dict()
    checked = 0
    for name, want in model.state_dict().items():
        if ours[name].numel():
            assert torch.equal(ours[name], want), name
            checked += name.endswith("proj.weight")
    return checked


def save_char_tokenizer(folder: str | os.PathLike) -> None:
    """A character-level tokenizer for the tiny models (printable ASCII -> ids 1..95, 0 unknown), written with
    ``save_pretrained`` so ``AutoTokenizer.from_pretrained(folder)`` loads it offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): i + 1 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(os.fspath(folder))


#: a small chat template (roles in tags, one line per message) every tiny tokenizer here can encode
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")

#: the whole words the SentencePiece-style tokenizer has pieces for (the rest is spelled in letters)
SP_WORDS = ("experts", "machines", "the", "hello", "world", "mixture", "of", "model", "tokens", "serve", "ray",
            "and", "a", "is", "to", "in")


def save_chat_template(folder: str | os.PathLike, template: str = CHAT_TEMPLATE) -> None:
    """Add ``template`` as the chat template of the tokenizer saved in ``folder`` (``apply_chat_template``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True)
    tok.chat_template = template
    tok.save_pretrained(os.fspath(folder))


def save_sentencepiece_tokenizer(folder: str | os.PathLike, *, vocab_size: int = VOCAB) -> None:
    """A SentencePiece-style tokenizer (Unigram pieces, ``Metaspace`` pre-tokenizer and decoder: ``▁`` marks a
    space, dropped at the start of the text) of exactly ``vocab_size`` ids: ``<unk>`` 0, ``<s>`` 1 (BOS, added
    to text by ``add_special_tokens=True``), ``</s>`` 2 (EOS), then whole words (``SP_WORDS``) with ``▁``,
    single letters with and without ``▁``, digits and punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁"] + [f"▁{w}" for w in SP_WORDS]
    pieces += [c for c in "abcdefghijklmnopqrstuvwxyz"] + [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    pieces += [c for c in "0123456789.,!?'-:<>/\n"] + [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pieces = list(dict.fromkeys(pieces))[:vocab_size]
    pieces += [f"<extra_{i}>" for i in range(vocab_size - len(pieces))]
    # whole words score higher than their letters, so Viterbi picks them
    vocab = [(p, 0.0 if i < 3 else (-1.0 if len(p) > 2 else -8.0)) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            add_bos_token=True).save_pretrained(os.fspath(folder))


def save_byte_level_tokenizer(folder: str | os.PathLike) -> None:
    """A byte-level BPE tokenizer (GPT-2 style ``ByteLevel`` pre-tokenizer and decoder) whose ids below
    ``VOCAB`` (the tiny models' vocabulary) hold ``<|endoftext|>`` 0, printable ASCII and newline, the lone bytes of
    ``é`` (0xC3 0xA9), ``€`` (0xE2 0x82 0xAC) and ``日`` (0xE6 0x97 0xA5) with merges for ``é``, ``ca``, ``caf``
    and ``café``: a tiny model's output then often splits a character over tokens. The other bytes sit at ids
    from ``VOCAB`` up (the model never samples them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_char.values()) == set(alphabet)
    low = [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xE6, 0x97, 0xA5] + list(range(32, 127)) + [0x0A]
    vocab: dict[str, int] = {"<|endoftext|>": 0}
    for b in low:
        vocab.setdefault(byte_char[b], len(vocab))
    e_acute = byte_char[0xC3] + byte_char[0xA9]
    merges = [(byte_char[0xC3], byte_char[0xA9]), ("c", "a"), ("ca", "f"), ("caf", e_acute)]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) <= VOCAB, len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<|extra_{len(vocab)}|>"] = len(vocab)
    for b in range(256):
        vocab.setdefault(byte_char[b], len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(os.fspath(folder))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (what ``ByteLevel`` maps bytes to)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
