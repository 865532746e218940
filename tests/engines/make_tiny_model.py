"""Create a tiny Llama for the engine tests: random weights from a seed, a local word-level
tokenizer, nothing from a model hub.

    python tests/engines/make_tiny_model.py OUT_DIR [--seed N] [--layers N] [--hidden H] [--dtype float32]

The same seed makes the same weights, so two model directories with different seeds have the
same shapes and config but other weights (the engine tests use that for "other weights at the
same path"). The vocabulary is ``w0 .. w{V-1}`` plus ``<s> </s> <unk> <pad>``: a prompt is any
space-separated run of those words, one token each.

``--hidden`` widens the model (hidden H, MLP 4·H, H/32 query heads; the default 128 keeps its
MLP of 256, so the tests' model is unchanged) and keeps its KV as it is
(2 KV heads of 32 dimensions): prefill compute grows about as H², the bytes a restore loads do
not (the LUMEN benchmark uses that for a prefill well over its restore).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_WORDS = 2000


def make(out: Path, seed: int, layers: int, dtype: str, max_len: int, hidden: int = 128) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.model_max_length = max_len
    # a chat template in the vocabulary's words (w1 system, w2 user, w3 assistant, w4 the
    # generation prompt), so that vLLM's chat endpoints and /tokenize render messages
    fast.chat_template = (
        "{% for m in messages %}"
        "{{ 'w1' if m['role'] == 'system' else ('w2' if m['role'] == 'user' else 'w3') }} "
        "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    )
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=256 if hidden == 128 else 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: outputs depend on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    (out / "generation_config.json").write_text(json.dumps(gen))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write the model into")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=128,
                   help="hidden size, a multiple of 64 (default 128); the KV heads stay 2 x 32")
    p.add_argument("--dtype", default="float32", help="weights dtype (default float32)")
    p.add_argument("--max-len", type=int, default=4096, help="max positions (default 4096)")
    a = p.parse_args()
    if a.hidden < 64 or a.hidden % 64:
        p.error(f"--hidden {a.hidden}: give a multiple of 64 (H/32 query heads over 2 KV heads)")
    make(a.out, a.seed, a.layers, a.dtype, a.max_len, a.hidden)
    print(f"tiny llama (seed {a.seed}, {a.layers} layers, hidden {a.hidden}, {a.dtype}) in {a.out}")


if __name__ == "__main__":
    main()
