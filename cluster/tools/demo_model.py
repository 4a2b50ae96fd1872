"""The built-in demo model: a small random-weight Llama with a trained byte-level BPE tokenizer.

Nothing is downloaded: the tokenizer is trained on a built-in text, the weights are drawn
from a seed, and the result is an ordinary Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template) that
``transformers`` loads too - which is what makes it a correctness oracle in tests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3; workloads draw prompt ids from [4, vocab)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving system batches requests so the
accelerator stays busy; prefill reads the prompt, decode writes one token at a time.
Paged attention keeps the key and value cache in fixed-size blocks, like pages of memory.
Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1024.
Unicode text too: café, naïve, Straße, 日本語のテキスト, 中文字符, emoji 🙂🚀, Ελληνικά, русский.
def main():\n    print("hello")\n    return 0\n
The router looks at the shape of every request: how long the prompt is, how many tokens it
may generate, how much of it is already cached, and which pool should run it.
"""


@dataclass(frozen=True)
class DemoModelSpec:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # llama | mistral | qwen2
    rope_theta: float = 10000.0
    #: Llama-3 style rope scaling factor; None for plain RoPE.
    llama3_rope_factor: float | None = None
    #: Weight std. Larger than the usual 0.02 so random-weight logits are well separated and
    #: greedy decoding does not hinge on last-bit rounding.
    init_std: float = 0.1
    seed: int = 0


_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries.

    A small corpus trains fewer merges than a model's vocabulary has rows, so filler entries fill the BPE
    vocabulary up to ``vocab_size`` (no merge produces them, like a real model's unused rows; they decode to
    ``<extra_N>``). They are vocabulary entries, not added tokens: a real 32k-vocabulary tokenizer has a
    handful of added tokens, and transformers copies every added token when it loads a tokenizer (31k of
    them cost the bench model's replica ~2.7 s of its start, loading and copying)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need >= 260)")
    state = json.loads(tok.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    i = 0
    while next_id < vocab_size:
        filler = f"<extra_{i}>"  # printable ASCII: byte-level decoding maps each character to itself
        i += 1
        if filler not in vocab:
            vocab[filler] = next_id
            next_id += 1
    return Tokenizer.from_str(json.dumps(state))


def write_demo_model(path: str | Path, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Writes a Hugging Face model directory for ``spec`` at ``path`` and returns the path."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch_name, model_type = _ARCH[spec.architecture]
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    config = {
        "architectures": [arch_name],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "float32",
        "initializer_range": spec.init_std,
    }
    if spec.llama3_rope_factor:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": spec.llama3_rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max(16, spec.max_position_embeddings // 4),
        }
    if spec.architecture == "mistral":
        config["sliding_window"] = None
    if spec.architecture == "qwen2":
        config["use_sliding_window"] = False
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "shapeserve_demo.json").write_text(json.dumps(_marker(spec), indent=2))

    # Imported here: ``ensure_demo_model`` on an existing directory (every ``shapeserve serve``) needs no torch.
    import torch

    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * spec.init_std

    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    q_out, kv_out = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": 1.0 + rand(h) * 0.1}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": 1.0 + rand(h) * 0.1,
            p + "post_attention_layernorm.weight": 1.0 + rand(h) * 0.1,
            p + "self_attn.q_proj.weight": rand(q_out, h),
            p + "self_attn.k_proj.weight": rand(kv_out, h),
            p + "self_attn.v_proj.weight": rand(kv_out, h),
            p + "self_attn.o_proj.weight": rand(h, q_out),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
        if spec.architecture == "qwen2":
            tensors |= {
                p + "self_attn.q_proj.bias": rand(q_out),
                p + "self_attn.k_proj.bias": rand(kv_out),
                p + "self_attn.v_proj.bias": rand(kv_out),
            }
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(v, h)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return path


#: Bumped when the files written for the same spec change (2: filler tokens in the BPE vocabulary).
DEMO_FORMAT = 2


def _marker(spec: DemoModelSpec) -> dict:
    """What ``shapeserve_demo.json`` holds: the spec and the format it was written in."""
    return {**asdict(spec), "format": DEMO_FORMAT}


def default_demo_model_dir() -> Path:
    """Where ``shapeserve serve`` keeps the demo model it builds when no --model is given."""
    import os

    root = Path(os.environ.get("SHAPESERVE_CACHE", Path.home() / ".cache" / "shapeserve"))
    return root / "demo-model"


def ensure_demo_model(path: str | Path | None = None, spec: DemoModelSpec = DemoModelSpec()) -> Path:
    """Builds the demo model at ``path`` unless a complete one with the same spec is there."""
    path = Path(path) if path else default_demo_model_dir()
    marker = path / "shapeserve_demo.json"
    if marker.is_file() and json.loads(marker.read_text()) == _marker(spec) and (path / "model.safetensors").is_file():
        return path
    return write_demo_model(path, spec)
