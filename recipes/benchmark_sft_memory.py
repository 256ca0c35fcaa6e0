"""A fine-tuning file's cost to each training rank: peak anonymous memory per rank against the file's size.

    python recipes/benchmark_sft_memory.py                      # chat files of 25 MB, 100 MB and 1 GB (made once)
    python recipes/benchmark_sft_memory.py --mb 25 100          # other sizes

For each size a synthetic chat file (recipes/benchmark_sft_prepare.py's, with its byte-level BPE and ChatML template)
is prepared once into its cache; then, in a fresh process per data-parallel rank (2 ranks, each its own process), the
training side runs as a rank runs it: ``FineTuneDataModule.setup`` (the cache opened and checked, the rows indexed)
and 64 micro-batches of 4 rows of 512 tokens from the training loader. Printed per rank: the peak anonymous memory
(``RssAnon`` of ``/proc/self/status`` sampled after setup and after every batch: what the rank holds itself; the
memory-mapped cache's pages are the page cache's, shared by every rank of a node), and the resident peak
(``ru_maxrss``, those mapped pages included), in MiB.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: helpers of the recipes package

RANKS, BATCHES = 2, 64


def _anonymous_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rank(data: str, tokenizer: str, rank: int, queue: mp.Queue) -> None:
    from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule

    module = FineTuneDataModule(data, tokenizer, block_size=512, batch_size=4, progress=False)
    module.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": RANKS, "rank": rank},
                                     accumulate_grad_batches=1, local_rank=rank, lightning_module=None)
    module.setup("fit")
    peak = _anonymous_mib()
    batches = iter(module.train_dataloader())
    for _ in range(BATCHES):
        next(batches)
        peak = max(peak, _anonymous_mib())
    queue.put((len(module.cache.lengths), len(module.train_rows), peak,
               resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, nargs="*", default=[25.0, 100.0, 1000.0], help="chat file sizes, MB")
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "lightning_seqpar_sft_bench"))
    args = parser.parse_args()
    from lightning_seqpar.extras import require_extra

    require_extra("hf", "recipes/benchmark_sft_memory.py (a Hugging Face tokenizer)")  # said before any process starts
    from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule
    from recipes.benchmark_sft_prepare import in_fresh_process, make_chat_file, make_tokenizer

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    title = f"Fine-tuning data per training rank ({RANKS} ranks, {BATCHES} micro-batches of 4 × 512 tokens)"
    table = Table(title=title)
    for column in ("file MB", "records", "rows", "rank", "peak anonymous MiB", "peak RSS MiB (mapped cache included)"):
        table.add_column(column, justify="right")
    tokenizer = root / "tokenizer"
    for megabytes in args.mb:
        data = root / f"chat-{megabytes:g}MB.jsonl"
        make_chat_file(data, megabytes)
        make_tokenizer(tokenizer, data)
        FineTuneDataModule(str(data), str(tokenizer), progress=False).prepare_cache()  # once, before the ranks
        for rank in range(RANKS):
            records, rows, anonymous, resident = in_fresh_process(_rank, str(data), str(tokenizer), rank)
            table.add_row(f"{data.stat().st_size / 1e6:.0f}", f"{records:,}", f"{rows:,}", str(rank),
                          f"{anonymous:.0f}", f"{resident:.0f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
