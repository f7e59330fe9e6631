"""Build the tiny model vLLM serves in the end-to-end test: run with the vLLM venv's python.

No weights can be downloaded in CI, and the test needs none that mean anything: prefix
caching only cares about token ids. So this writes a Llama with random weights (hidden 128,
2 layers, 4 heads, vocab 4,096, safetensors) and a byte-level BPE tokenizer trained here on a
seeded word list, with a chat template. Everything is seeded: two runs give the same files.

    python build_model.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

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
SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vu", "pe", "dor", "sil", "ny", "qua", "bex",
             "tor", "ela", "fin", "gru", "hap", "jis", "kel", "mon"]


def corpus(rng: random.Random, lines: int = 12000) -> list[str]:
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5)))
             for _ in range(12000)]
    words += ["system", "user", "assistant", "the", "cache", "prefix", "turn", "agent"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "."
            for _ in range(lines)]


def build_tokenizer(out: Path, rng: random.Random) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    build_tokenizer(out, rng)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    build_model(out, max(VOCAB_SIZE, len(vocab)))
    print(json.dumps({"dir": str(out), "vocab": len(vocab)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
