"""Preparing a large fine-tuning file: throughput and peak memory of the streaming preparation, on one core.

    python recipes/benchmark_sft_prepare.py                 # a 1 GB chat file (made once under the temporary folder)
    python recipes/benchmark_sft_prepare.py --mb 64         # a smaller one

A synthetic chat file of ``--mb`` MB (conversations of one to three exchanges over a fixed word list, ~1 KB each) is
rendered with a ChatML template (no ``{% generation %}`` markers, like most models' templates) and a byte-level BPE
tokenizer trained offline on a sample of it. Each measurement runs in a fresh process pinned to one core (the Rust
tokenizer limited to one thread): ``FineTuneDataModule.prepare_cache`` preparing the cache from scratch (the
streaming, batched path), and, on the first ``--sample-mb`` MB, the record-at-a-time rendering the preparation used
before (one ``apply_chat_template`` per prefix and per record, everything held in memory), and the ceiling of any
preparation with this tokenizer: the Rust tokenizer alone encoding the same texts, rendered by hand. Prints MB/s and
the peak resident memory of each process (``ru_maxrss``: the interpreter and libraries included).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the a of to and in is it that for on with as was by be this are or from at an not have but they his her "
         "which one you were all we there can been has more if will would when so no what out up about into than "
         "time some could them other then its only new two may first also after any like over such our these how "
         "model data train loss token layer tensor sequence parallel memory gradient optimizer batch").split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def make_chat_file(path: Path, megabytes: float, seed: int = 0) -> None:
    """A JSON Lines chat file of about ``megabytes`` MB, written once."""
    if path.is_file() and path.stat().st_size >= megabytes * 1e6:
        return
    rng, written = random.Random(seed), 0
    tmp = path.with_suffix(".partial")
    with tmp.open("w", encoding="utf-8") as out:
        while written < megabytes * 1e6:
            messages = [{"role": "system", "content": _sentence(rng, 8)}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": _sentence(rng, rng.randint(8, 40))},
                             {"role": "assistant", "content": " ".join(_sentence(rng, 12)
                                                                       for _ in range(rng.randint(1, 6)))}]
            line = json.dumps({"messages": messages}) + "\n"
            out.write(line)
            written += len(line)
    tmp.replace(path)


def make_tokenizer(directory: Path, sample: Path) -> None:
    """A byte-level BPE of 8 192 ids trained on the first MB of ``sample``, with the ChatML template."""
    if (directory / "tokenizer.json").is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    with sample.open(encoding="utf-8") as lines:
        texts = [line for _, line in zip(range(2000), lines)]
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:2])
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)


def _one_core() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"  # the Rust tokenizer's batch threads
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _streaming(data: str, tokenizer: str, cache_dir: str, queue: mp.Queue) -> None:
    _one_core()
    from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule

    start = time.perf_counter()
    module = FineTuneDataModule(data, tokenizer, cache_dir=cache_dir, progress=False)
    meta = json.loads((module.prepare_cache() / "meta.json").read_text())
    seconds = time.perf_counter() - start
    queue.put((seconds, meta["examples"], meta["tokens"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def _record_at_a_time(data: str, tokenizer: str, megabytes: float, queue: mp.Queue) -> None:
    """The preparation before: every record rendered alone, its prefixes tokenized one by one, all kept."""
    _one_core()
    import numpy as np

    from lightning_seqpar.data.tokenizer import load_tokenizer

    hf = load_tokenizer(tokenizer).tokenizer
    start, read, examples = time.perf_counter(), 0, []
    with open(data, "rb") as lines:
        for line in lines:
            read += len(line)
            messages = json.loads(line)["messages"]
            ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            supervised = np.zeros(len(ids), dtype=bool)
            for i, message in enumerate(messages):
                if message["role"] == "assistant":
                    before = hf.apply_chat_template(messages[:i], tokenize=True, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]
                    through = hf.apply_chat_template(messages[:i + 1], tokenize=True, return_dict=True)["input_ids"]
                    supervised[len(before):len(through)] = True
            examples.append((np.asarray(ids), supervised))
            if read >= megabytes * 1e6:
                break
    seconds = time.perf_counter() - start
    queue.put((seconds, len(examples), sum(len(e[0]) for e in examples),
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, read))


def _tokenizer_alone(data: str, tokenizer: str, megabytes: float, queue: mp.Queue) -> None:
    """The ceiling: the Rust tokenizer alone encoding the rendered texts of the first ``megabytes`` MB (with the
    character offsets the assistant mask is read from), nothing else timed."""
    _one_core()
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    texts, read = [], 0
    with open(data, "rb") as lines:
        for line in lines:
            read += len(line)
            texts.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                                 for m in json.loads(line)["messages"]))  # CHATML, rendered by hand
            if read >= megabytes * 1e6:
                break
    start = time.perf_counter()
    tokens = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
    seconds = time.perf_counter() - start
    queue.put((seconds, len(texts), tokens, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, read))


def in_fresh_process(target, *args):
    """``target(*args, queue)`` in a new (spawned) process: what it puts on the queue."""
    ctx = mp.get_context("spawn")  # a fresh process: its peak memory is this measurement's alone
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1024.0, help="size of the chat file, MB")
    parser.add_argument("--sample-mb", type=float, default=4.0, help="MB rendered record at a time (the old path)")
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "lightning_seqpar_sft_bench"))
    args = parser.parse_args()
    from lightning_seqpar.extras import require_extra

    require_extra("hf", "recipes/benchmark_sft_prepare.py (a Hugging Face tokenizer)")  # said before any process starts
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"chat-{args.mb:g}MB.jsonl"
    make_chat_file(data, args.mb)
    make_tokenizer(root / "tokenizer", data)
    size = data.stat().st_size
    with tempfile.TemporaryDirectory() as cache_dir:
        seconds, records, tokens, peak = in_fresh_process(_streaming, str(data), str(root / "tokenizer"), cache_dir)
    old_seconds, old_records, old_tokens, old_peak, old_read = in_fresh_process(
        _record_at_a_time, str(data), str(root / "tokenizer"), args.sample_mb)
    ceiling = in_fresh_process(_tokenizer_alone, str(data), str(root / "tokenizer"), args.sample_mb)
    table = Table(title=f"Preparing {data.name} on one core (ChatML template, byte-level BPE of 8 192 ids)")
    for column in ("path", "MB read", "records", "tokens", "seconds", "MB/s", "peak RSS MB"):
        table.add_column(column, justify="right")
    table.add_row("streaming, batched (now)", f"{size / 1e6:.0f}", f"{records:,}", f"{tokens:,}", f"{seconds:.1f}",
                  f"{size / 1e6 / seconds:.2f}", f"{peak / 1e6:.0f}")
    table.add_row("record at a time (before)", f"{old_read / 1e6:.0f}", f"{old_records:,}", f"{old_tokens:,}",
                  f"{old_seconds:.1f}", f"{old_read / 1e6 / old_seconds:.2f}", f"{old_peak / 1e6:.0f}")
    c_seconds, c_records, c_tokens, c_peak, c_read = ceiling
    table.add_row("tokenizer alone (the ceiling)", f"{c_read / 1e6:.0f}", f"{c_records:,}", f"{c_tokens:,}",
                  f"{c_seconds:.1f}", f"{c_read / 1e6 / c_seconds:.2f}", f"{c_peak / 1e6:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
