"""Telemetry sinks: numbers in, lines out. Phase timers and memory figures, the per-window Metrics (stdout or the
progress bar, metrics.jsonl, TensorBoard, Weights & Biases), trimming metrics.jsonl on resume, and loss.png.
Nothing here runs the model: the loop evaluates and hands the results to Metrics.write."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.batch import Batch, attended_positions
from fsdp_lib.data.plan import DataPlan
from fsdp_lib.errors import TrainError
from fsdp_lib.faults import fault_point
from fsdp_lib.runtime import Dist, broadcast_object, log
from fsdp_lib.state import TrainState
from fsdp_lib.train.samples import SAMPLES_FILE

# Dense bf16 tensor-core peak TFLOP/s per GPU (vendor datasheets), and fp32 (no TF32) peak.
PEAK_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5)}


def peak_tflops(cfg: TrainConfig, precision: str) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (half, full) in PEAK_TFLOPS.items():
        if key in name:
            return full if precision == "fp32" else half
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB. On CUDA the allocator's counters; on CPU the process's resident set (current and peak)."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "mem_curr_alloc_gb": torch.cuda.memory_allocated(device) / gib,
            "mem_peak_alloc_gb": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gb": torch.cuda.memory_reserved(device) / gib,
        }
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                status[key] = int(value.split()[0]) * 1024 / gib
    return {
        "mem_curr_alloc_gb": status.get("VmRSS", 0.0),
        "mem_peak_alloc_gb": status.get("VmHWM", 0.0),
        "mem_reserved_gb": status.get("VmRSS", 0.0),
    }


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)


class PhaseTimer:
    """Per-phase times over a logging window. On CUDA, events are recorded and read only at log time,
    so timing adds no host-device sync to the step loop."""

    PHASES = (
        "data",
        "forward",
        "backward",
        "update",
    )  # always reported; others (GRPO's "generate", KTO's "reference_point") once timed

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.host_ms = dict.fromkeys(self.PHASES, 0.0)
        self.events: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase `name` (a named range in a --profile-steps trace too)."""
        with torch.profiler.record_function(name):
            if self.cuda and name != "data":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
                self.events.append((name, start, end))
            else:
                t0 = time.perf_counter()
                yield
                self.host_ms[name] = self.host_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000

    def averages(self, steps: int) -> dict[str, float]:
        totals = dict(self.host_ms)
        if self.events:
            torch.cuda.synchronize()
            for name, start, end in self.events:
                totals[name] = totals.get(name, 0.0) + start.elapsed_time(end)
        return {f"time_{k}_ms": v / max(1, steps) for k, v in totals.items()}


class Metrics:
    """Window accumulators on the device; one sync per log line. Writes stdout, metrics.jsonl, TensorBoard, W&B."""

    def __init__(
        self,
        cfg: TrainConfig,
        d: Dist,
        plan: DataPlan,
        flops_per_token: Callable[[float], float],
        precision: str,
        steps: range,
        window_figures: Callable[[torch.Tensor, float], dict[str, float]] | None = None,
    ):
        """flops_per_token: model FLOPs per token of the positions a token attends over (build.flops_per_token).
        steps: the optimizer steps this run trains (first..last): the progress bar starts at the first.
        window_figures: an objective's (e.g. DPO's) rule that turns its figures summed over a window and over the
        ranks, and the window's seconds, into fields of the log record; the sink knows no objective's vocabulary."""
        self.cfg, self.d, self.window_figures = cfg, d, window_figures
        self.global_batch, self.steps_per_epoch = plan.global_batch, plan.steps_per_epoch
        self.mixture_names = plan.mixture.names if plan.mixture is not None else None
        self.tokens_per_step = plan.global_batch * cfg.seq_length
        self.flops_per_token, self.peak = flops_per_token, peak_tflops(cfg, precision)
        self.path = cfg.experiment_dir / "metrics.jsonl"
        self.timer = PhaseTimer(d.device)
        self.writer = None
        self.failure: str | None = None  # why metrics.jsonl could not be written (rank 0)
        if d.is_main and cfg.tensorboard == "on":
            from torch.utils.tensorboard import SummaryWriter

            # What a killed launch logged from this run's first step on (from step 0 when it starts from scratch) is
            # dropped, as metrics.jsonl's lines are (trim_metrics_file), so TensorBoard does not show it twice.
            purge = steps.start if steps.start > 1 else 0
            self.writer = SummaryWriter(str(cfg.experiment_dir / "tensorboard"), purge_step=purge)
        self.wandb_run = start_wandb(cfg) if d.is_main and cfg.wandb == "on" else None
        self.bar = None
        if d.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            # total steps and the ETA (log lines go through bar.write, so they do not tear it)
            self.bar = tqdm(
                desc="train", unit="step", total=steps.stop - 1, initial=steps.start - 1, dynamic_ncols=True
            )
        self._new_window()

    def _new_window(self) -> None:
        self.window_loss = torch.zeros((), device=self.d.device, dtype=torch.float64)
        self.window_steps = self.window_trained = 0
        self.window_carried = 0  # of window_steps: trained before a resume (resume_window), not timed here
        self.window_stats: torch.Tensor | None = None  # the objective's figures summed over the window
        self.window_sources: list[int] | None = None  # a mixture: blocks per dataset over the window
        self.window_attended = [0, 0]  # documents' squared lengths and tokens (attended_positions), for the MFU
        self.window_start = time.perf_counter()
        self.timer.reset()
        reset_peak_memory(self.d.device)

    def carried_window(self) -> dict | None:
        """The open window summed over the ranks, for the checkpoint (TrainState.log_window); None when it is empty.
        A collective: every rank calls it at every save."""
        if not self.window_steps:
            return None
        sums = torch.tensor([0.0, *self.window_attended], dtype=torch.float64, device=self.d.device)
        sums[0] += self.window_loss.to(sums.device)
        dist.all_reduce(sums)
        stats = None
        if self.window_stats is not None:
            stats = self.window_stats.to(self.d.device, torch.float64, copy=True)  # the window keeps its own
            dist.all_reduce(stats)
        return {
            "steps": self.window_steps,
            "trained": self.window_trained,
            "loss": sums[0].item(),
            "attended": sums[1:].tolist(),
            "stats": None if stats is None else stats.tolist(),
            "sources": self.window_sources,
        }

    def resume_window(self, carried: dict | None) -> None:
        """Continue a checkpoint's open window (carried_window), on any number of processes: its sums on rank 0,
        zeros elsewhere, its counts on every rank. Its steps are not timed here: emit rates them at this run's pace."""
        if not carried:
            return
        main = self.d.rank == 0
        self.window_steps = self.window_carried = carried["steps"]
        self.window_trained, self.window_sources = carried["trained"], carried["sources"]
        if main:
            self.window_loss += carried["loss"]
            self.window_attended = [int(a) for a in carried["attended"]]
        if carried["stats"] is not None:
            stats = torch.tensor(carried["stats"], dtype=torch.float64, device=self.d.device)
            self.window_stats = stats if main else torch.zeros_like(stats)

    def epoch_progress(self, state: TrainState) -> float:
        """Epochs done as a fraction, e.g. 1.25 = a quarter into the second epoch."""
        return round(state.epoch + state.samples_in_epoch / (self.steps_per_epoch * self.global_batch), 4)

    def record(
        self,
        local_loss_sum: torch.Tensor,
        trained_tokens: int,
        aux_loss: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
        sources: list[int] | None = None,
        batches: list[Batch] | None = None,
    ) -> None:
        """trained_tokens: the global batch's targets that carry loss (the same number on every rank; for DPO its
        pairs); aux_loss: the step's MoE router loss (weighted; not part of `loss`), or None; stats: the step's
        objective's figures on this rank (summed over the window, turned into a record's fields by `window_figures`), or None; sources: a mixture's global batch, blocks per
        dataset (the same on every rank), or None; batches: the step's micro-batches on this rank (their documents'
        lengths give the MFU's attention span), or None."""
        self.last_aux = aux_loss
        if sources is not None:
            self.window_sources = [a + b for a, b in zip(self.window_sources or [0] * len(sources), sources)]
        if stats is not None:
            self.window_stats = stats if self.window_stats is None else self.window_stats + stats
        if batches is not None and self.peak:
            self.window_attended = [a + b for a, b in zip(self.window_attended, attended_positions(batches))]
        self.window_loss += local_loss_sum.detach().double()
        self.window_steps += 1
        self.window_trained += trained_tokens
        self.last_loss, self.last_trained = local_loss_sum.detach().double(), trained_tokens
        if self.bar is not None:
            self.bar.update(1)

    def due(self, step: int) -> bool:
        return step % self.cfg.log_freq == 0

    def emit(self, state: TrainState, lr: float, grad_norm: torch.Tensor, skipped_steps: int) -> dict:
        """The window's log record. grad_norm: the last step's gradient norm, or one per optimizer update of it
        (GRPO's --num-iterations): their mean, and each as grad_norm/update_K."""
        # The one host sync of the window: global loss sums across ranks, then .item().
        attended = torch.tensor(self.window_attended, dtype=torch.float64, device=self.d.device)
        sums = torch.cat([torch.stack([self.last_loss, self.window_loss]).to(self.d.device), attended])
        dist.all_reduce(sums)
        timed = self.window_steps - self.window_carried  # a resumed window's earlier steps, at the measured pace
        elapsed = (time.perf_counter() - self.window_start) * self.window_steps / max(1, timed)
        step_sum, window_sum, squares, tokens = sums.tolist()
        norms = grad_norm.double().flatten().tolist()
        record = {
            "step": state.step,
            "epoch": self.epoch_progress(state),
            # None (null, "n/a") where no token carried loss (a chat batch of prompt-only pieces): it read 0
            "loss": step_sum / self.last_trained if self.last_trained else None,
            "loss_avg": window_sum / self.window_trained if self.window_trained else None,
            "lr": lr,
            "grad_norm": sum(norms) / len(norms) if self.last_trained else None,  # no target: no update, no norm
            "skipped_steps": skipped_steps,
        }
        if len(norms) > 1:
            record.update({f"grad_norm/update_{k}": norm for k, norm in enumerate(norms, 1)})
        record["tokens_per_s"] = self.tokens_per_step * self.window_steps / elapsed  # all tokens, trained or not
        record["trained_tokens"] = self.window_trained
        record["trained_tokens_per_s"] = self.window_trained / elapsed
        if self.window_stats is not None and self.window_figures is not None:  # the objective's own figures
            stats = self.window_stats.to(self.d.device)
            dist.all_reduce(stats)
            record.update(self.window_figures(stats, elapsed))
        if self.window_sources is not None and self.mixture_names:  # samples (blocks) per dataset
            record.update({f"samples/{n}": c for n, c in zip(self.mixture_names, self.window_sources)})
        record.update(self.timer.averages(timed))
        record.update(self.memory_over_ranks())
        if self.last_aux is not None:
            aux = self.last_aux.detach().clone()
            dist.all_reduce(aux)
            record["aux_loss"] = aux.item() / self.d.world_size
        if self.peak:  # attention counted over each token's document: packed documents kept apart cost less
            span = squares / tokens if tokens else self.cfg.seq_length
            flops = record["tokens_per_s"] * self.flops_per_token(span)
            record["mfu"] = flops / (self.peak * 1e12 * self.d.world_size)
        self.write(record)
        self._new_window()
        return record

    def memory_over_ranks(self) -> dict[str, float]:
        """Each memory figure's maximum over the ranks (the one that runs out first), and rank 0's own."""
        mine = memory_stats(self.d.device)
        figures = torch.tensor(list(mine.values()), dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.d.cpu_group)
        return {**dict(zip(mine, figures.tolist())), **{f"{k}_rank0": v for k, v in mine.items()}}

    def write(self, record: dict) -> None:
        if not self.d.is_main:
            return
        record = {"time": dt.datetime.now().isoformat(timespec="seconds"), **record}
        try:
            fault_point("metrics_write", self.d, record["step"])
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:  # disk full: the loop stops the run after a checkpoint attempt (see stop_if_failed)
            self.failure = self.failure or f"cannot write {self.path} ({exc}); free disk space and rerun to resume"
        if self.writer is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self.writer.add_scalar(key, value, record["step"])
        if self.wandb_run is not None:  # "step" is logged as the x axis (see start_wandb); W&B keeps its own time
            self.wandb_run.log({k: v for k, v in record.items() if k != "time" and v is not None})
        message = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={'n/a' if v is None else v}"
            for k, v in record.items()
            if k != "time"
        )
        if self.bar is not None:
            self.bar.write(message)
        else:
            log(message)

    def write_samples(self, step: int, rows: list[dict[str, str]]) -> None:
        """--sample-prompts: the completions of one evaluation, to samples.jsonl (beside metrics.jsonl), TensorBoard
        and W&B as text, and the first three to the log (rank 0)."""
        if not self.d.is_main or not rows:
            return
        try:
            with open(self.path.with_name(SAMPLES_FILE), "a") as fh:
                fh.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        except OSError as exc:  # as for metrics.jsonl: the loop checkpoints and stops the run
            self.failure = self.failure or f"cannot write {SAMPLES_FILE} ({exc}); free disk space and rerun to resume"
        if self.writer is not None:
            for i, row in enumerate(rows):
                self.writer.add_text(
                    f"samples/{i}", f"**prompt:** {row['prompt']}\n\n**completion:** {row['completion']}", step
                )
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(
                columns=["step", "prompt", "completion"], data=[[step, r["prompt"], r["completion"]] for r in rows]
            )
            self.wandb_run.log({"step": step, "samples": table})
        for row in rows[:3]:
            log(f"sample at step {step}: {row['prompt'][-80:]!r} -> {row['completion'][:200]!r}")

    def stop_if_failed(self) -> None:
        """After the run saved a checkpoint on a write failure: every rank stops with rank 0's message."""
        failure = broadcast_object(self.failure, self.d)
        if failure:
            raise TrainError(failure)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.bar is not None:
            self.bar.close()


def trim_metrics_file(path: Path, step: int) -> None:
    """On resume (rank 0): drop the lines of metrics.jsonl a killed run wrote after the checkpoint it resumes
    from, and lines cut short (a kill or a full disk while logging). The kept lines go to a new file that replaces
    the old one, so a kill at this moment leaves either file, never an empty one."""
    if not path.is_file():
        return
    kept, broken = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(keepends=True), 1):
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if line.strip():
                broken.append(number)
        elif record.get("step", 0) <= step:
            kept.append(line)
    if broken:
        log(f"note: dropped {len(broken)} incomplete line(s) of {path} (line {', '.join(map(str, broken))})")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.writelines(kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TrainError(f"cannot rewrite {path} ({exc}); free disk space or fix permissions and rerun") from exc


def start_wandb(cfg: TrainConfig) -> Any:
    """Rank 0's Weights & Biases run, with the resolved config (what config.yaml holds).

    Offline unless WANDB_MODE is set (these machines have no internet): files go to outputs/EXP/wandb and
    `wandb sync` uploads them later. The run id is kept in outputs/EXP/wandb/run_id, so a resumed experiment
    continues the same run (resume="allow"). Records are plotted against our "step", not W&B's own step counter:
    a resume logs again the steps after its checkpoint, and W&B drops rows whose own step goes backwards."""
    import uuid

    import wandb

    folder = cfg.experiment_dir / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    id_file = folder / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits; no W&B helper (its home moves between versions)
        id_file.write_text(run_id + "\n")
    try:
        run = wandb.init(
            dir=str(cfg.experiment_dir),  # W&B adds the wandb/ folder itself
            id=run_id,
            resume="allow",
            mode=os.environ.get("WANDB_MODE", "offline"),
            project=os.environ.get("WANDB_PROJECT", "fsdp-train"),
            name=cfg.experiment_name,
            config=dataclasses.asdict(cfg),
            settings=wandb.Settings(console="off"),  # our log lines and the progress bar stay as they are
        )
    except Exception as exc:  # e.g. WANDB_MODE=online without a key or network: one message, not a traceback
        raise TrainError(f"--wandb on: wandb.init failed ({exc}); set WANDB_MODE=offline or use --wandb off") from exc
    run.define_metric("*", step_metric="step")
    return run


def plot_metrics(metrics_path: Path, out_png: Path, title: str) -> None:
    """loss.png: train loss, validation loss (per token, or per pair for DPO) and the learning rate by step. Never
    fails the run; nothing to draw (a run stopped before its first metric line) draws nothing."""
    if not metrics_path.is_file():
        return
    try:
        from matplotlib.figure import Figure  # not pyplot: no global figure state, GUI backend lookup or its import

        rows = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        train = [(r["step"], r["loss"], r["lr"]) for r in rows if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if not train and not val:
            return
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        if train:
            ax.plot([t[0] for t in train], [t[1] for t in train], label="train loss (global batch)")
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss")
        ax.set_xlabel("optimizer step")
        pairs = any("rewards/accuracies" in r or "val_rewards/accuracies" in r for r in rows)  # --objective dpo
        ax.set_ylabel("DPO loss (mean per pair)" if pairs else "cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if train:
            lr_ax = ax.twinx()
            lr_ax.plot([t[0] for t in train], [t[2] for t in train], color="gray", ls=":", label="learning rate")
            lr_ax.set_ylabel("learning rate")
            lr_ax.legend(loc="upper center")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out_png.with_name(out_png.name + ".tmp.png"), dpi=120)
        os.replace(out_png.with_name(out_png.name + ".tmp.png"), out_png)
    except Exception as exc:  # noqa: BLE001 - a plot is a convenience; the run's results are in metrics.jsonl
        log(f"could not write {out_png} ({type(exc).__name__}: {exc}); the figures are in {metrics_path}")
