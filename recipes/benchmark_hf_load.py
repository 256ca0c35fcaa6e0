"""Loading and exporting a pretrained Hugging Face model across ranks: host memory and time per rank.

    python recipes/benchmark_hf_load.py --tp 2                    # a 315M-parameter Llama, tp 2, built on the meta device
    python recipes/benchmark_hf_load.py --tp 2 --pp 2 --mode eager  # every rank loads the whole model first

The model directory (``--dir``; default: a 315M-parameter Llama with a tied 8192-token vocabulary, written once
in several safetensors files under the system's temporary folder) is loaded as ``HFCausalLMModule(pretrained=DIR)``
(``meta``: each rank reads only its shards and stage) or with ``from_pretrained`` in ``__init__`` (``eager``),
validated on one batch, then exported with ``save_hf_pretrained``. Per rank: peak resident growth while loading
(× the model's float32 bytes), load seconds, peak resident growth while exporting (MiB) and export seconds, in a
plain process (glibc's defaults). One layout and mode per run: a process's memory history would blur the next.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, TensorDataset

from lightning_seqpar import SeqParallelStrategy
from lightning_seqpar.extras import require_extra
from lightning_seqpar.models import HFCausalLMModule

LLAMA_315M = dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=26,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=True)


def _resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _directory(path: str | None) -> Path:
    directory = Path(path) if path else Path(tempfile.gettempdir()) / "lightning_seqpar_llama315m"
    if not (directory / "config.json").exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA_315M))
        model.save_pretrained(directory, max_shard_size="200MB")
        os.sync()  # freshly written pages are dirty; a process mapping them is charged for them
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--mode", choices=("meta", "eager"), default="meta")
    parser.add_argument("--dir", default=None, help="a local Hugging Face model directory")
    args = parser.parse_args()
    require_extra("hf", "recipes/benchmark_hf_load.py (a Hugging Face Llama)")  # said before any process starts
    directory = _directory(args.dir)

    before, start = _resident(), time.perf_counter()
    module = HFCausalLMModule(pretrained=str(directory))
    if args.mode == "eager":
        import transformers

        module.model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens = torch.randint(0, module.hf_config.vocab_size, (4, 16))
    trainer = pl.Trainer(accelerator="cpu", devices=args.tp * args.pp, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, strategy=SeqParallelStrategy(tp=args.tp, pp=args.pp))
    trainer.validate(module, DataLoader(TensorDataset(tokens, tokens), batch_size=4), verbose=False)
    load_peak, load_seconds = _peak() - before, time.perf_counter() - start
    whole = 4 * _parameter_count(module.hf_config)

    _reset_peak()
    before, start = _resident(), time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        trainer.strategy.save_hf_pretrained(Path(trainer.strategy.broadcast(out)) / "export", max_shard_size="200MB")
        export_peak, export_seconds = _peak() - before, time.perf_counter() - start
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (load_peak / whole, load_seconds, export_peak / 2**20, export_seconds))
    if dist.get_rank() == 0:
        table = Table(title=f"{args.mode}: {whole / 1e9:.2f} GB model (float32), tp={args.tp} pp={args.pp}")
        for column in ("rank", "load peak growth (x model)", "load s", "export peak growth (MiB)", "export s"):
            table.add_column(column, justify="right")
        for rank, (load, load_s, export, export_s) in enumerate(rows):
            table.add_row(str(rank), f"{load:.3f}", f"{load_s:.1f}", f"{export:.1f}", f"{export_s:.1f}")
        Console().print(table)


def _parameter_count(config) -> int:
    import transformers

    with torch.device("meta"):
        return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


if __name__ == "__main__":
    main()
