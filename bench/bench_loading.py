"""Peak host memory per process when loading a pretrained model: fsdp_train.py's sharded loading against
`from_pretrained` on every process.

    python bench/bench_loading.py            # ~100M-parameter Llama (390 MB fp32 / 195 MB bf16), 1 and 2 processes
    python bench/bench_loading.py --quick    # tiny model, one repetition: proves the benchmark still runs

Each run is its own torchrun launch (gloo, CPU). After `setup_distributed` and every import either side
needs, each process records its resident memory (VmRSS), resets its peak (/proc/self/clear_refs 5), loads
into fp32 (fsdp_train.py's master weights), and reports its peak. The sides:

- sharded: `fsdp_train.build_model`: the model is built on the meta device, fully_shard-ed, and each process
  reads only its slices of the safetensors files (DCP's Hugging Face reader);
- full: `AutoModelForCausalLM.from_pretrained(dtype=float32)` on every process, then the same
  `fsdp_train.shard_model`: how FSDP code is commonly written.
Neither runs the trainer's start-up probes (`build_model(..., probes=False)`): forward passes, not loading.

Two peaks per process, because they tell different stories:
- VmHWM, the kernel's peak resident set. It counts pages of the memory-mapped safetensors file a process
  has touched; those are page cache, shared by all processes on the machine and reclaimable.
- peak private (anonymous) memory, sampled every millisecond from /proc/self/status (RssAnon; the kernel
  keeps no peak of it): the memory each process really owns, which adds up across processes.
The weights are written once in bf16 (how Llama, Qwen and Mistral ship) and once in fp32; the files are in
the page cache for both sides.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import bench_arg_parser, interleaved, machine_info, median, print_table, work_folder, write_results
from inputs import make_corpus, make_llama_folder
from launch import torchrun

FULL = {"hidden": 768, "layers": 12, "vocab": 16384, "reps": 2, "dtypes": ("bfloat16", "float32")}
QUICK = {"hidden": 64, "layers": 2, "vocab": 512, "reps": 1, "dtypes": ("bfloat16",)}
MODES = ("sharded", "full")
MB = 2**20


def memory_status() -> dict[str, float]:
    """This process's VmRSS, VmHWM (peak RSS), RssAnon and RssFile, in MiB."""
    wanted = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            status[key] = int(value.split()[0]) / 1024
    return status


class AnonPeak:
    """Samples RssAnon every millisecond on a thread while the block runs; `peak_mb` is the highest seen."""

    def __enter__(self) -> AnonPeak:
        self.peak_mb, self._stop = memory_status()["RssAnon"], threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak_mb = max(self.peak_mb, memory_status()["RssAnon"])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, memory_status()["RssAnon"])


# --- Worker: runs under torchrun ----------------------------------------------------------------------------


def warm_up_imports(model_dir: str) -> None:
    """Import everything either side imports lazily (the architecture's modeling code, DCP, FSDP), so the
    memory measured before loading holds the code and the difference is the weights."""
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def loading_worker(mode: str, model_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.model.anatomy import find_decoder_layers
    from fsdp_lib.model.build import build_model, shard_model
    from fsdp_lib.runtime import setup_distributed

    cfg = TrainConfig(model_name=model_dir, precision="fp32")
    cfg.activation_checkpointing = "off"
    d = setup_distributed(cfg)
    warm_up_imports(model_dir)
    before = memory_status()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS: the peak is the load's
    start = time.perf_counter()
    with AnonPeak() as anon:
        if mode == "sharded":
            model = build_model(cfg, "fp32", d, probes=False).model
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            shard_model(model, find_decoder_layers(model), cfg, "fp32", d)
    seconds = time.perf_counter() - start
    after = memory_status()
    report = {
        "rss_before_mb": before["VmRSS"],
        "anon_before_mb": before["RssAnon"],
        "peak_rss_mb": after["VmHWM"],
        "peak_anon_mb": anon.peak_mb,
        "rss_after_mb": after["VmRSS"],
        "anon_after_mb": after["RssAnon"],
        "own_shard_mb": sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / MB,
        "seconds": seconds,
    }
    reports = [None] * d.world_size
    dist.all_gather_object(reports, report, group=d.cpu_group)
    if d.is_main:
        Path(out).write_text(json.dumps(reports))
    dist.destroy_process_group()


# --- Orchestration ------------------------------------------------------------------------------------------


def load_once(model_dir: Path, mode: str, nproc: int, out: Path) -> dict[str, Any]:
    """One launch; the figures of the process with the highest private peak (rank 0 also holds the
    tied embedding's share and the odd remainder of every split)."""
    torchrun(Path(__file__), ["--worker", mode, str(model_dir), str(out)], nproc)
    ranks = json.loads(out.read_text())
    worst = max(ranks, key=lambda r: r["peak_anon_mb"])
    return {**worst, "peak_anon_per_rank_mb": [round(r["peak_anon_mb"]) for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    args = bench_arg_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    p = QUICK if args.quick else FULL
    reps = args.reps or p["reps"]
    info = machine_info()
    runs: dict[str, list] = {}
    weights_mb: dict[str, float] = {}
    with work_folder(args, "bench_loading_") as work:
        texts = make_corpus(500_000)
        for dtype in p["dtypes"]:
            model_dir = make_llama_folder(
                work / dtype, texts, p["hidden"], p["layers"], p["vocab"], weights_dtype=dtype
            )
            weights_mb[dtype] = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / MB
            print(f"{dtype} weights: {weights_mb[dtype]:.0f} MiB", flush=True)
            for nproc in (1, 2):
                sides = {
                    f"{mode} {dtype} x{nproc}": (
                        lambda m=mode, n=nproc, d=model_dir: load_once(d, m, n, work / "report.json")
                    )
                    for mode in MODES
                }
                runs |= interleaved(
                    reps, sides, summary=lambda r: f"private peak per rank {r['peak_anon_per_rank_mb']} MiB"
                )
    rows, summary = [], {}
    for dtype in p["dtypes"]:
        for nproc in (1, 2):
            peaks: dict[str, dict[str, float]] = {}
            for mode in MODES:
                rs = runs[f"{mode} {dtype} x{nproc}"]
                fig = {k: median([r[k] for r in rs]) for k in rs[0] if isinstance(rs[0][k], float)}
                peaks[mode] = fig
                rows.append(
                    [
                        mode,
                        f"{dtype} ({weights_mb[dtype]:.0f} MiB)",
                        nproc,
                        fig["rss_before_mb"],
                        fig["peak_anon_mb"] - fig["anon_before_mb"],
                        fig["peak_rss_mb"] - fig["rss_before_mb"],
                        fig["rss_after_mb"] - fig["rss_before_mb"],
                        fig["own_shard_mb"],
                        fig["seconds"],
                    ]
                )
            summary[f"{dtype} x{nproc}"] = {
                "full_over_sharded_private_peak": (peaks["full"]["peak_anon_mb"] - peaks["full"]["anon_before_mb"])
                / (peaks["sharded"]["peak_anon_mb"] - peaks["sharded"]["anon_before_mb"]),
                "full_over_sharded_vmhwm": peaks["full"]["peak_rss_mb"] / peaks["sharded"]["peak_rss_mb"],
                "figures_mb": peaks,
            }
    print_table(
        [
            "loading",
            "weights on disk",
            "processes",
            "RSS after imports (MiB)",
            "private peak - before",
            "VmHWM - before",
            "RSS after - before",
            "own fp32 shard (MiB)",
            "load (s)",
        ],
        rows,
    )
    for key, s in summary.items():
        print(
            f"{key}: full / sharded, private peak growth {s['full_over_sharded_private_peak']:.2f}, "
            f"VmHWM {s['full_over_sharded_vmhwm']:.2f}"
        )
    write_results(
        args.results_dir,
        "loading",
        {
            "machine": info,
            "params": {**p, "reps": reps, "weights_mib": weights_mb},
            "summary": summary,
            "runs": runs,
        },
    )
    return 0


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # launched by torchrun from load_once
        loading_worker(sys.argv[2], sys.argv[3], sys.argv[4])
        exit_without_teardown(0)
    sys.exit(main())
