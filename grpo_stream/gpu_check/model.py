"""The model and prompts of `scripts/gpu-check.sh`'s ~1B phases.

    python -m grpo_stream.gpu_check.model OUT --shape llama-3.2-1b|tiny --gsm8k DIR [--limit N]

writes OUT, a Hugging Face checkpoint directory that `model.kind=hf model.path=OUT` loads: the known
Llama-3.2-1B shape (`common/model/known_architectures.py`, the shape `bench/gpu.py` measures: 1.24B parameters,
vocabulary 128,256, tied embeddings) with random weights in bfloat16, or `tiny` (the same family at the dry run's
size), and a BPE tokenizer trained on DIR's GSM8K text. The tokenizer's vocabulary (a few thousand tokens) is
smaller than the model's: prompts have GSM8K's lengths in tokens, and ids past the tokenizer's, which a random model
samples, decode to nothing. It prints one JSON line (parameters, vocabularies, seconds).

`gsm8k_source` finds the GSM8K files where they can be (an explicit directory, $GRPO_STREAM_GSM8K_DIR,
../shared/data/gsm8k beside the checkout, or the sample `scripts/gpu-wheels.sh` copies into .whl/gsm8k to travel
with the wheels) or, failing all, writes GSM8K-shaped problems (several sentences, a `#### N` answer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHAPE = "llama-3.2-1b"
# the dry run's model: bench/gpu.py's quick sampler model, with room for GSM8K's vocabulary
TINY = {"vocab_size": 4096, "num_layers": 2, "embed_dim": 64, "hidden_dim": 128, "num_heads": 2, "num_kv_heads": 1,
        "head_dim": 32}
TOKENIZER_VOCAB = 8192  # at most (the model's vocabulary caps it); GSM8K's text gives fewer merges


def gsm8k_source(explicit: str | None, work: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(directory with train.jsonl and test.jsonl, where it came from)."""
    candidates = [(explicit, "--gsm8k"), (os.environ.get("GRPO_STREAM_GSM8K_DIR"), "$GRPO_STREAM_GSM8K_DIR"),
                  (str(ROOT.parent / "shared" / "data" / "gsm8k"), "../shared/data/gsm8k"),
                  (str(ROOT / ".whl" / "gsm8k"), ".whl/gsm8k (the sample scripts/gpu-wheels.sh carries)")]
    for path, what in candidates:
        if path and all((pathlib.Path(path) / f"{split}.jsonl").is_file() for split in ("train", "test")):
            return pathlib.Path(path).resolve(), what
    return write_gsm8k_shaped(work / "gsm8k-shaped"), "GSM8K-shaped problems written here (no GSM8K files found)"


def write_gsm8k_shaped(directory: pathlib.Path, rows: int = 1200, seed: int = 0) -> pathlib.Path:
    """Word problems of GSM8K's shape (a few sentences, 40-70 words; a worked solution ending in `#### N`)."""
    rng = random.Random(seed)
    names = ["Janet", "Tom", "Aisha", "Marco", "Lena", "Ravi", "Sofia", "Ben"]
    items = [("apples", "apple"), ("pencils", "pencil"), ("stickers", "sticker"), ("cupcakes", "cupcake")]
    directory.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", rows), ("test", rows // 6)):
        with open(directory / f"{split}.jsonl", "w") as out:
            for _ in range(count):
                name, friend = rng.sample(names, 2)
                (many, one), a, b, price = rng.choice(items), rng.randint(10, 60), rng.randint(2, 9), rng.randint(2, 7)
                c = rng.randint(1, a // 2)
                left = a + b * 4 - c
                question = (f"{name} has {a} {many} in a box at home. Every week for 4 weeks, {name} buys {b} more "
                            f"{many} at the market on Saturday morning. Then {name} gives {c} {many} to {friend}, "
                            f"who lives next door. Each {one} is worth ${price}. How many dollars are the {many} "
                            f"{name} has left worth?")
                answer = (f"{name} buys {b} * 4 = {b * 4} {many}.\n{name} then has {a} + {b * 4} - {c} = {left} "
                          f"{many}.\nThey are worth {left} * {price} = {left * price} dollars.\n#### {left * price}")
                out.write(json.dumps({"question": question, "answer": answer}) + "\n")
    return directory


def corpus(gsm8k: pathlib.Path, limit: int) -> list[str]:
    """The questions and solutions of the first `limit` training rows: the tokenizer's training text."""
    texts = []
    with open(gsm8k / "train.jsonl", encoding="utf-8") as lines:
        for line in lines:
            if line.strip() and len(texts) < 2 * limit:
                row = json.loads(line)
                texts += [row["question"], row["answer"]]
    return texts


def make_checkpoint(out: pathlib.Path, shape: str, gsm8k: pathlib.Path, limit: int) -> dict:
    import jax.numpy as jnp  # noqa: PLC0415 - parse the arguments first

    from grpo_stream.common.model.hf_checkpoint import export_hf  # noqa: PLC0415
    from grpo_stream.common.model.known_architectures import known_architecture  # noqa: PLC0415
    from grpo_stream.common.model.policy import build_from_architecture  # noqa: PLC0415
    from grpo_stream.common.model.tokenizer import train_bpe  # noqa: PLC0415

    started = time.perf_counter()
    arch = known_architecture(SHAPE)
    if shape == "tiny":
        arch = dataclasses.replace(arch, **TINY)
    tokenizer = train_bpe(corpus(gsm8k, limit), min(TOKENIZER_VOCAB, arch.vocab_size))
    tokenizer.save(out)
    model = build_from_architecture(arch, 0, jnp.bfloat16)
    export_hf(out, arch, model.to_named_numpy(), dtype="bfloat16", eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    return {"shape": shape, "path": str(out), "params": model.num_params(), "vocab_size": arch.vocab_size,
            "tokenizer_vocab_size": tokenizer.vocab_size, "pad_token": "<pad>", "dtype": "bfloat16",
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the checkpoint directory to write")
    parser.add_argument("--shape", choices=(SHAPE, "tiny"), default=SHAPE)
    parser.add_argument("--gsm8k", type=pathlib.Path, required=True, help="directory with train.jsonl")
    parser.add_argument("--limit", type=int, default=2000, help="training rows the tokenizer learns from")
    args = parser.parse_args(argv)
    print(json.dumps(make_checkpoint(args.out, args.shape, args.gsm8k, args.limit)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
