"""Benchmark data_hf.py against the standard datasets route on the same generated corpus.

    python bench/bench_data_hf.py                  # 1024 MB corpus in a temporary folder, removed afterwards
    python bench/bench_data_hf.py --size-mb 64 --workdir /tmp/bench_data_hf --keep
    python bench/bench_data_hf.py --quick          # 4 MB corpus: proves the benchmark still runs

The corpus mixes .txt, .md, .json (arrays of records), .jsonl and multi-document .yaml, including one text
file large enough to be read in pieces. Each route runs in its own fresh process; the benchmark samples the
resident memory of that process and all its children from /proc every 20 ms, so the peak is the whole process
tree's (workers included), not one process's.

Routes:
- data_hf: `data_hf.py` on the .txt/.md/.json/.jsonl files, the same files as the standard route;
- standard: `datasets.load_dataset("text", ...)` on .txt/.md and `load_dataset("json", ...)` on .json/.jsonl,
  each followed by `save_to_disk` (datasets has no YAML loader, so YAML is left out of both), with defaults;
- standard_num_proc: the same with `num_proc` set like data_hf.py's (`load_dataset` and `save_to_disk`);
- data_hf_all: data_hf.py on the whole corpus, YAML included (for information; nothing to compare it with).

With --reps N every route runs N times, routes interleaved (ABBA order); the table shows each route's run of
median time. Results are printed as a table and written as JSON (default bench/results/data_hf.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from common import REPO_ROOT, bench_arg_parser, interleaved, machine_info, write_results

# Share of the corpus bytes per kind; "big_txt" is one text file read in pieces by data_hf.py.
MIX = {"txt": 0.30, "big_txt": 0.05, "md": 0.05, "json": 0.20, "jsonl": 0.30, "yaml": 0.10}
STANDARD_EXTENSIONS = (".txt", ".md", ".json", ".jsonl")
SAMPLE_SECONDS = 0.02
FULL = {"size_mb": 1024, "reps": 1}
QUICK = {"size_mb": 4, "reps": 1}


# --- Corpus -------------------------------------------------------------------------------------------------


class TextMaker:
    """Fast pseudo-prose: paragraphs drawn from a pre-built pool, with some non-ASCII words for UTF-8."""

    def __init__(self, rng: random.Random) -> None:
        letters = "abcdefghijklmnopqrstuvwxyz"
        words = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(20_000)]
        words += ["café", "naïve", "Straße", "über", "数据", "модель", "εξαγωγή"] * 50
        self.rng = rng
        self.paragraphs = [" ".join(rng.choices(words, k=rng.randint(20, 160))) + "." for _ in range(4000)]

    def text(self, size: int) -> str:
        parts, total = [], 0
        while total < size:
            paragraph = self.rng.choice(self.paragraphs)
            parts.append(paragraph)
            total += len(paragraph) + 2
        return "\n\n".join(parts) + "\n"

    def record(self, index: int) -> dict[str, object]:
        return {
            "id": index,
            "title": self.text(40)[:60].strip(),
            "body": self.text(self.rng.randint(200, 3000)),
            "tags": [self.rng.choice(self.paragraphs)[:12], self.rng.choice(self.paragraphs)[:12]],
            "meta": {"source": f"source-{index % 17}", "score": round(self.rng.random(), 4)},
        }


def generate_corpus(folder: Path, size_mb: float, seed: int) -> dict[str, int]:
    """Write about `size_mb` MB of mixed files under `folder`; returns bytes written per kind."""
    rng = random.Random(seed)
    maker = TextMaker(rng)
    target = {kind: int(share * size_mb * 1e6) for kind, share in MIX.items()}
    written = dict.fromkeys(MIX, 0)
    record_index = 0

    def new_path(kind: str, count: int, suffix: str) -> Path:
        path = folder / kind / f"part_{count // 500:03d}" / f"{kind}_{count:06d}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    for kind, suffix, low, high in (("txt", ".txt", 2_000, 2_000_000), ("md", ".md", 1_000, 50_000)):
        count = 0
        while written[kind] < target[kind]:
            data = maker.text(int(low * (high / low) ** rng.random())).encode()  # log-uniform sizes
            new_path(kind, count, suffix).write_bytes(data)
            written[kind] += len(data)
            count += 1
    if target["big_txt"]:
        path = new_path("big_txt", 0, ".txt")
        with path.open("wb") as fh:
            while written["big_txt"] < target["big_txt"]:
                data = maker.text(4_000_000).encode()
                fh.write(data)
                written["big_txt"] += len(data)
    for kind, suffix, low, high in (("json", ".json", 100_000, 5_000_000), ("jsonl", ".jsonl", 1_000_000, 20_000_000)):
        count = 0
        while written[kind] < target[kind]:
            want, records, size = int(low * (high / low) ** rng.random()), [], 0
            while size < want:
                records.append(maker.record(record_index))
                record_index += 1
                size += len(records[-1]["body"]) + 200
            if kind == "json":
                data = json.dumps(records, ensure_ascii=False, indent=1).encode()
            else:
                data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
            new_path(kind, count, suffix).write_bytes(data)
            written[kind] += len(data)
            count += 1
    count = 0
    while written["yaml"] < target["yaml"]:
        records = [maker.record(record_index + i) for i in range(rng.randint(10, 200))]
        record_index += len(records)
        data = yaml.safe_dump_all(records, allow_unicode=True, sort_keys=False).encode()
        new_path("yaml", count, ".yaml").write_bytes(data)
        written["yaml"] += len(data)
        count += 1
    return written


# --- Measuring a route --------------------------------------------------------------------------------------


def _tree_rss(root: int) -> tuple[int, dict[int, int]]:
    """(summed VmRSS of `root` and all its descendants, VmHWM per pid), in bytes, from /proc."""
    total, peaks, todo = 0, {}, [root]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in os.listdir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmRSS" in fields:
            total += int(fields["VmRSS"].split()[0]) * 1024
            peaks[pid] = int(fields["VmHWM"].split()[0]) * 1024
    return total, peaks


@dataclass
class RouteResult:
    route: str
    command: list[str]
    input_bytes: int
    seconds: float
    mb_per_s: float
    peak_tree_rss_mb: float  # sampled every SAMPLE_SECONDS: the sum over the process tree
    sum_of_process_peaks_mb: float  # each process's own peak (VmHWM), summed: an upper bound
    output_bytes: int
    returncode: int


def run_route(name: str, command: list[str], input_bytes: int, output: Path, env: dict[str, str]) -> RouteResult:
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak, process_peaks = 0, {}
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while process.poll() is None:
        total, peaks = _tree_rss(process.pid)
        peak = max(peak, total)
        for pid, value in peaks.items():
            process_peaks[pid] = max(process_peaks.get(pid, 0), value)
        time.sleep(SAMPLE_SECONDS)
    seconds = time.monotonic() - started
    reader.join()
    tail = b"".join(lines).decode(errors="replace")[-3000:]
    print(f"--- {name}: exit {process.returncode} after {seconds:.1f} s\n{tail}", flush=True)
    output_bytes = sum(p.stat().st_size for p in output.rglob("*") if p.is_file()) if output.exists() else 0
    return RouteResult(
        route=name,
        command=command,
        input_bytes=input_bytes,
        seconds=round(seconds, 2),
        mb_per_s=round(input_bytes / 1e6 / seconds, 2),
        peak_tree_rss_mb=round(peak / 1e6, 1),
        sum_of_process_peaks_mb=round(sum(process_peaks.values()) / 1e6, 1),
        output_bytes=output_bytes,
        returncode=process.returncode,
    )


def standard_route(corpus: Path, output: Path, cache: Path, num_proc: int | None) -> None:
    """The usual datasets recipe: load_dataset("text") and load_dataset("json"), then save_to_disk."""
    import datasets

    files = sorted(p for p in corpus.rglob("*") if p.suffix in STANDARD_EXTENSIONS)
    text_files = [str(p) for p in files if p.suffix in (".txt", ".md")]
    json_files = [str(p) for p in files if p.suffix in (".json", ".jsonl")]
    for builder, data_files in (("text", text_files), ("json", json_files)):
        loaded = datasets.load_dataset(
            builder, data_files=data_files, split="train", cache_dir=str(cache), num_proc=num_proc
        )
        loaded.save_to_disk(str(output / builder), num_proc=num_proc)
        print(f"standard {builder}: {len(loaded)} rows, columns {loaded.column_names}")


# --- Main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=0, help="corpus size in MB (0 = 1024, or 4 with --quick)")
    parser.add_argument("--keep", action="store_true", help="keep --workdir afterwards")
    parser.add_argument("--num-proc", type=int, help="data_hf.py --num-proc (default: its own default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routes", nargs="+", default=["data_hf", "standard", "standard_num_proc", "data_hf_all"])
    parser.add_argument("--standard-route", nargs=4, help=argparse.SUPPRESS)  # corpus output cache num_proc
    args = parser.parse_args(argv)
    if args.standard_route:  # the standard route, run in its own process by the benchmark
        corpus, output, cache, num_proc = args.standard_route
        standard_route(Path(corpus), Path(output), Path(cache), int(num_proc) or None)
        return 0
    p = QUICK if args.quick else FULL
    args.size_mb = args.size_mb or p["size_mb"]
    reps = args.reps or p["reps"]
    info = machine_info()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_data_hf_"))
    corpus = workdir / "corpus"
    try:
        recipe = {"size_mb": args.size_mb, "seed": args.seed, "mix": MIX}
        marker = workdir / "corpus_recipe.json"
        if not (corpus.exists() and marker.exists() and json.loads(marker.read_text()) == recipe):
            shutil.rmtree(corpus, ignore_errors=True)
            started = time.monotonic()
            written = generate_corpus(corpus, args.size_mb, args.seed)
            print(f"generated {sum(written.values()) / 1e6:.1f} MB in {time.monotonic() - started:.1f} s: {written}")
            marker.write_text(json.dumps(recipe))
        else:
            print(f"reusing the corpus in {corpus} (same --size-mb and --seed)")
        sizes = {p: p.stat().st_size for p in corpus.rglob("*") if p.is_file()}
        standard_bytes = sum(size for p, size in sizes.items() if p.suffix in STANDARD_EXTENSIONS)
        all_bytes = sum(sizes.values())
        # Everything (HF caches included) stays under workdir: nothing lands in ~/.cache.
        env = dict(os.environ, HF_HOME=str(workdir / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        num_proc = ["--num-proc", str(args.num_proc)] if args.num_proc else []
        procs = str(args.num_proc or len(os.sched_getaffinity(0)))  # data_hf.py's default
        data_hf = [sys.executable, str(REPO_ROOT / "data_hf.py"), "--data_folder", str(corpus), "--overwrite"]
        routes = {
            "data_hf": (
                data_hf + ["--save_dir", str(workdir / "out_data_hf"), "--extensions", *STANDARD_EXTENSIONS] + num_proc,
                standard_bytes,
                workdir / "out_data_hf",
            ),
            "standard": (
                [sys.executable, str(Path(__file__).resolve()), "--standard-route", str(corpus), str(workdir / "out_standard"), str(workdir / "cache"), "0"],
                standard_bytes,
                workdir / "out_standard",
            ),
            "standard_num_proc": (
                [sys.executable, str(Path(__file__).resolve()), "--standard-route", str(corpus), str(workdir / "out_standard"), str(workdir / "cache"), procs],
                standard_bytes,
                workdir / "out_standard",
            ),
            "data_hf_all": (data_hf + ["--save_dir", str(workdir / "out_data_hf_all")] + num_proc, all_bytes, workdir / "out_data_hf_all"),
        }  # fmt: skip

        def run(name: str) -> RouteResult:
            command, input_bytes, output = routes[name]
            shutil.rmtree(output, ignore_errors=True)
            shutil.rmtree(workdir / "cache", ignore_errors=True)
            return run_route(name, command, input_bytes, output, env)

        runs = interleaved(
            reps,
            {name: (lambda n=name: run(n)) for name in args.routes},
            summary=lambda r: f"{r.seconds:.1f} s, {r.mb_per_s:.1f} MB/s, peak {r.peak_tree_rss_mb:.0f} MB",
        )
        # each route's run of median time (the run itself for one repetition)
        results = [sorted(rs, key=lambda r: r.seconds)[(len(rs) - 1) // 2] for rs in runs.values()]
        summary = (
            f"{platform.node()} {platform.machine()}, {len(os.sched_getaffinity(0))} cores available, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, Python {platform.python_version()}"
        )
        report = {
            "date": info["date"],
            "machine": {**info, "summary": summary},
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "params": {"size_mb": args.size_mb, "seed": args.seed, "reps": reps, "num_proc": args.num_proc},
            "corpus_mb": round(all_bytes / 1e6, 1),
            "corpus_without_yaml_mb": round(standard_bytes / 1e6, 1),
            "results": [asdict(r) for r in results],
            "runs": {name: [asdict(r) for r in rs] for name, rs in runs.items()},
        }
        print_table(report)
        write_results(args.results_dir, "data_hf", report)
        return 0 if all(r.returncode == 0 for r in results) else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def print_table(report: dict[str, object]) -> None:
    results = {r["route"]: r for r in report["results"]}  # type: ignore[attr-defined]
    print(f"\n{report['machine']['summary']}, {report['date']}")  # type: ignore[index]
    print(f"corpus {report['corpus_mb']} MB ({report['corpus_without_yaml_mb']} MB without YAML)")
    print(
        f"{'route':<18} {'input MB':>9} {'seconds':>8} {'MB/s':>7} {'peak RSS MB':>12} {'sum of peaks MB':>16} {'exit':>5}"
    )
    for r in results.values():
        print(
            f"{r['route']:<18} {r['input_bytes'] / 1e6:>9.1f} {r['seconds']:>8.1f} {r['mb_per_s']:>7.1f} "
            f"{r['peak_tree_rss_mb']:>12.1f} {r['sum_of_process_peaks_mb']:>16.1f} {r['returncode']:>5}"
        )
    for baseline in ("standard", "standard_num_proc"):
        if "data_hf" in results and baseline in results:
            ours, theirs = results["data_hf"], results[baseline]
            print(
                f"data_hf / {baseline}: throughput x{ours['mb_per_s'] / theirs['mb_per_s']:.2f}, "
                f"peak memory x{ours['peak_tree_rss_mb'] / theirs['peak_tree_rss_mb']:.2f}"
            )


if __name__ == "__main__":
    sys.exit(main())
