"""Build a tiny model vLLM serves in the end-to-end tests: run with the vLLM venv's python.

No weights can be downloaded in CI, and the tests need none that mean anything: prefix
caching only cares about token ids. So this writes a model with random weights (safetensors)
and a byte-level BPE tokenizer trained here on a seeded word list, with a chat template.
Everything is seeded: two runs give the same files.

    python build_model.py OUTPUT_DIR [ARCHITECTURE]

ARCHITECTURE is one of ``ARCHITECTURES``: ``llama`` (the default: hidden 128, 2 layers, 4
heads), or a hybrid whose recurrent state makes vLLM raise its attention block size until one
attention page holds one state page, so that the cache granule is no flag but a consequence of
the shape (``HYBRID_GRANULES``, as vLLM 0.32's CPU build sizes them):

- ``granite-2048``: GraniteMoeHybrid (Granite-4.0-H-like), [mamba, attention] x 2, Mamba2 8
  heads x 32 with ``mamba_d_state=960``, no experts: granule 2,048 (the field reports' one);
- ``nemotron-h-384``: NemotronH, mamba / attention / mlp / mamba: granule 384, no power of two;
- ``qwen3-next-640``: Qwen3-Next, gated DeltaNet (linear attention, head dim 128: the CPU
  kernel rejects 32) and full attention, 4 experts top-2: granule 640.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 4096
SEED = 1234
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ren",
    "tas",
    "vu",
    "pe",
    "dor",
    "sil",
    "ny",
    "qua",
    "bex",
    "tor",
    "ela",
    "fin",
    "gru",
    "hap",
    "jis",
    "kel",
    "mon",
]
MAX_POSITIONS = 65536
# The granule vLLM 0.32 (CPU) settles on for each hybrid shape below: what the tests expect.
HYBRID_GRANULES = {"granite-2048": 2048, "nemotron-h-384": 384, "qwen3-next-640": 640}
ARCHITECTURES = ("llama", *HYBRID_GRANULES)


def corpus(rng: random.Random, lines: int = 12000) -> list[str]:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5))) for _ in range(12000)]
    words += ["system", "user", "assistant", "the", "cache", "prefix", "turn", "agent"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "." for _ in range(lines)
    ]


def build_tokenizer(out: Path, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def _common(vocab_size: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }


def model_for(architecture: str, vocab_size: int) -> Any:
    """The randomly initialised transformers model of one architecture."""
    import transformers

    common = _common(vocab_size)
    if architecture == "llama":
        config = transformers.LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
            torch_dtype="float32",
            **{k: v for k, v in common.items() if k != "pad_token_id"},
        )
        return transformers.LlamaForCausalLM(config)
    if architecture == "granite-2048":
        config = transformers.GraniteMoeHybridConfig(
            hidden_size=128,
            intermediate_size=256,
            shared_intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=1,
            mamba_d_state=960,
            mamba_expand=2,
            mamba_chunk_size=256,
            num_local_experts=0,
            num_experts_per_tok=0,
            max_position_embeddings=MAX_POSITIONS,
            position_embedding_type="rope",
            **common,
        )
        return transformers.GraniteMoeHybridForCausalLM(config)
    if architecture == "nemotron-h-384":
        config = transformers.NemotronHConfig(
            hidden_size=128,
            intermediate_size=256,
            layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=128,
            n_groups=1,
            expand=2,
            chunk_size=128,
            max_position_embeddings=MAX_POSITIONS,
            **common,
        )
        return transformers.NemotronHForCausalLM(config)
    if architecture == "qwen3-next-640":
        config = transformers.Qwen3NextConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            max_position_embeddings=MAX_POSITIONS,
            **common,
        )
        return transformers.Qwen3NextForCausalLM(config)
    raise SystemExit(f"unknown architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")


def build_model(out: Path, vocab_size: int, architecture: str = "llama") -> None:
    import torch

    torch.manual_seed(SEED)
    model = model_for(architecture, vocab_size)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    architecture = argv[2] if len(argv) > 2 else "llama"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    build_tokenizer(out, rng)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    build_model(out, max(VOCAB_SIZE, len(vocab)), architecture)
    print(json.dumps({"dir": str(out), "vocab": len(vocab), "architecture": architecture}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
