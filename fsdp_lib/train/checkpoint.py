"""Training checkpoints (DCP, sharded): the folder layout and its checksums, atomic saves (optionally in the
background), loading with the resume-compatibility check, and pruning. Which checkpoint to resume from
(discovery, verification, quarantine) is checkpoint_verify.py.

    outputs/EXP/checkpoint/step_00000020/  .metadata, __R_0.distcp (model + optimizer shards), rng_rankNNNNN.pt,
                                           train_state.json (TrainState, resume fingerprint), checksums.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import shutil
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.plan import TrainData
from fsdp_lib.errors import CheckpointError, describe_error, explain_write_error, name_sample
from fsdp_lib.experiment_dir import (
    PACKED_WHOLE,
    RESUME_REFUSED_FIX,
    adapter_difference,
    flags_changed_since,
    format_difference,
    keep_batch_hint,
    objective_difference,
    objective_name,
    packing_refusal,
    run_settings,
    without_reference_weights,
)
from fsdp_lib.faults import fault_point, save_delay
from fsdp_lib.integrity import file_checksum
from fsdp_lib.markers import EXPERIMENT_STATE, step_dirs
from fsdp_lib.model.adapters import target_names
from fsdp_lib.model.loss import micro_batch_note
from fsdp_lib.runtime import Dist, all_ranks_agree, log, seed_everything
from fsdp_lib.state import TrainState
from fsdp_lib.train.rewards import edited_rewards

# Settings that change the math or the data: a resume with a different value is refused.
RESUME_PINNED = (
    "model",
    "dataset",
    "seq_length",
    "global_batch_size",
    "seed",
    "tokenizer",
    "data_format",
    "peft",
    "objective",
    "epoch_blocks",
)
# What an --export-only compares (export_fingerprint): the rest changes nothing when nothing trains.
EXPORT_PINNED = ("model", "tokenizer", "peft")


def resume_fingerprint(
    cfg: TrainConfig,
    model_config: Any,
    data: TrainData,
    peft: Any = None,
    objective: dict | str = "lm",
    train_forward: Any = None,
) -> dict:
    """What a checkpoint must agree with to be resumed (RESUME_PINNED), as saved in its train_state.json.
    With --peft the checkpoint holds only the adapters, so the base's weights identity is pinned too; with
    --objective dpo the loss settings and the reference (dpo.build_objective). And the chat template the run's
    export writes, for an --export-only (not pinned: data_format holds the hash of each template the data used)."""
    return {
        "objective": objective,
        **export_fingerprint(cfg, model_config, data.tokenizer_hash, peft),
        "dataset": data.dataset_fingerprint,
        "seq_length": cfg.seq_length,
        "global_batch_size": data.train.global_batch,
        # what the same files and settings made: another version's tokenising, skips or packing moves the data
        "epoch_blocks": data.train.epoch_blocks,
        "seed": cfg.seed,
        "data_format": data.data_format,
        "chat_template": getattr(data.tokenizer, "chat_template", None),
        # not pinned: what the start-up probes chose (a resumed full fine-tune probes shards initialised for them)
        "start_up_choices": start_up_choices(train_forward),
    }


def start_up_choices(train_forward: Any) -> dict | None:
    """The loss chunk and document masking the start-up probes left the training forward with."""
    if train_forward is None:
        return None
    return {"loss_chunk_tokens": train_forward.chunk, "document_masking": train_forward.document_masking}


def export_fingerprint(cfg: TrainConfig, model_config: Any, tokenizer_hash: str, peft: Any = None) -> dict:
    """EXPORT_PINNED: the model, its tokenizer and adapters; with --peft the base's weights identity too."""
    adapters: dict | str = "none"
    if peft is not None:
        adapters = {
            "mode": cfg.peft,
            "rank": peft.config.r,
            "alpha": peft.config.lora_alpha,
            "dropout": peft.config.lora_dropout,
            "targets": target_names(peft.config),
            "base_weights": peft.base_identity,
            "start": peft.start,
        }
    return {"peft": adapters, "model": config_fingerprint(model_config), "tokenizer": tokenizer_hash}


def config_fingerprint(config: Any, with_path: bool = False) -> str:
    """The model's architecture settings; not the library version that wrote them, nor the load dtype, nor the
    folder it was read from (a moved model folder or HF_HOME is the same model). with_path: the fingerprint of
    versions before that change, which hashed the folder path (_name_or_path) too; a resume accepts either."""
    ignored = {"transformers_version", "dtype", "torch_dtype"} | (set() if with_path else {"_name_or_path"})
    settings = {k: v for k, v in config.to_dict().items() if k not in ignored}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


CHECKSUM_FILE = "checksums.json"  # {"algorithm": "crc32", "files": {name: {"bytes": n, "crc32": hex}}}


# DCP's CheckpointException derives from BaseException, not Exception.
CHECKPOINT_FAILURES = (Exception, dcp.api.CheckpointException)
# What a failed write raises: an OSError, or DCP's CheckpointException gathering the ranks' (e.g. a full disk while
# exporting final/ through DCP's Hugging Face writer)
WRITE_FAILURES = (OSError, dcp.api.CheckpointException)


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> BaseException | None:
    """Run fn; return its exception instead of raising, so every rank can be told about it first."""
    try:
        fn(*args, **kwargs)
    except CHECKPOINT_FAILURES as exc:
        return exc
    return None


@contextlib.contextmanager
def _writer_thread_failures() -> Iterator[list[BaseException]]:
    """The errors of DCP's extra writer threads (thread_count > 1): DCP neither joins their errors nor notices the
    results they never delivered, so a file one of them failed to write (a full disk, a file-size limit) left a
    checkpoint without its tensors, with checksums of the rest, and printed a thread traceback. Collected here so
    the save fails as any other failed write does; other threads' errors go to the usual hook."""
    failed: list[BaseException] = []
    previous = threading.excepthook

    def collect(args: Any) -> None:
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
        if args.exc_value is not None and any(f.name == "_write_files_from_queue" for f in frames):
            failed.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = collect
    try:
        yield failed
    finally:  # a failure of this thread's own writes leaves DCP's threads running: their failure is collected too
        for thread in threading.enumerate():  # (it printed a thread traceback above the run's one-line error)
            if thread.name.endswith("(_write_files_from_queue)") and thread is not threading.current_thread():
                thread.join(timeout=300)
        threading.excepthook = previous


class _CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer with fsync on and the fault-injection point inside DCP's write phase. Right after this
    rank wrote its files (in the background with --async-ckpt) it adds their checksums to `checksums`."""

    def __init__(self, path: str, d: Dist, step: int, checksums: dict):
        super().__init__(path, sync_files=True, thread_count=d.file_threads)
        self._dist, self._step, self.checksums = d, step, checksums

    def write_data(self, plan: Any, planner: Any) -> Any:
        fault_point("ckpt_write", self._dist, self._step)
        save_delay()
        with _writer_thread_failures() as failed:
            future = super().write_data(plan, planner)  # FileSystemWriter returns it completed
        if failed:
            raise failed[0]
        start = time.perf_counter()
        for name in sorted({result.storage_data.relative_path for result in future.value()}):
            self.checksums[name] = file_checksum(Path(self.path) / name)
        self.checksums["_seconds"] = time.perf_counter() - start
        return future


def host_staging(d: Dist) -> Any:
    """Where an async save copies the state before training goes on: kept from one save to the next (DCP's
    default stages into fresh pageable memory each time, so every save paid the allocation and its page faults while
    training waited; 2.2x the staging time for 384 MB on the CPU), pinned and filled without blocking on a GPU. The
    price is a host copy of this rank's model and optimizer shards held for the whole run."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # a torch before DefaultStager: DCP's own staging, fresh at every save
        return None
    gpu = d.device.type == "cuda"
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=gpu
        )
    )


class Checkpointer:
    """Atomic DCP checkpoints: each rank writes its shard into `.tmp_step_N/`; only after every rank has
    finished and the training state is written and synced does rank 0 rename it to `step_N/`.
    A run killed at any moment therefore leaves the previous checkpoint as the newest complete one."""

    def __init__(self, cfg: TrainConfig, d: Dist, fingerprint: dict):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.cfg, self.d, self.fingerprint = cfg, d, fingerprint
        # --peft: what trains (adapters, their optimizer state), never the frozen base, which the model folder holds
        peft = cfg.peft != "none"
        self.options = StateDictOptions(ignore_frozen_params=peft)
        # loading: the model's frozen keys are absent on purpose; DCP still fails on any requested key it lacks
        self.load_options = StateDictOptions(ignore_frozen_params=peft, strict=not peft)
        self.root = cfg.experiment_dir / "checkpoint"
        self.pending: tuple[Any, Path, int, dict] | None = None  # (future, tmp dir, step, checksums), async save
        self.staging: Any = None  # --async-ckpt: the host copy each save writes from, kept for the next (host_staging)
        self.checksum_s = 0.0  # seconds this rank spent on checksums in the last save (bench_checkpoint.py)

    def read_state(self, path: Path) -> dict:
        state_file = path / "train_state.json"
        try:
            payload = json.loads(state_file.read_text())
            TrainState(**payload["train_state"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint {path} is unreadable: {state_file} ({exc}). Nothing was resumed. Move that folder "
                f"aside to resume from the previous checkpoint, or use a new --experiment-name to start over."
            ) from exc
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint {path} is unreadable: {path / '.metadata'} is missing. Move that folder "
                f"aside to resume from the previous checkpoint."
            )
        return payload

    def changed_settings(self, payload: dict, model_config: Any) -> list[str]:
        """The pinned settings (RESUME_PINNED) in which this run differs from the checkpoint's payload."""
        saved = payload["fingerprint"]
        # A key the checkpoint lacks was added by a later version of this script: not a change of settings.
        pinned = EXPORT_PINNED if self.cfg.export_only else RESUME_PINNED
        changed = [k for k in pinned if k in saved and saved[k] != self.fingerprint.get(k)]
        if "model" in changed and saved["model"] == config_fingerprint(model_config, with_path=True):
            changed.remove("model")  # written by an older version, whose model fingerprint included the path
        if "objective" in changed and without_reference_weights(saved["objective"], self.fingerprint["objective"]):
            changed.remove("objective")  # an older version kept no identity of a live reference's weights
        if "epoch_blocks" in changed and {"dataset", "data_format", "seq_length", "tokenizer"} & set(changed):
            changed.remove("epoch_blocks")  # what the named change does to the data, not a change of its own
        return changed

    def _difference(self, key: str, payload: dict) -> str:
        """One changed setting as the user knows it: the model and dataset by their names, then their hashes."""
        was, now = payload["fingerprint"].get(key), self.fingerprint.get(key)
        flag = {"model": "model_name", "tokenizer": "model_name", "dataset": "dataset_name"}.get(key)
        named = payload.get("config", {}).get(flag) if flag else None
        if flag and named is not None and named != getattr(self.cfg, flag):
            return f"{key}: checkpoint {named!r} ({was}) vs now {getattr(self.cfg, flag)!r} ({now})"
        if key == "data_format" and str(was).replace(PACKED_WHOLE, "") == str(now).replace(PACKED_WHOLE, ""):
            return packing_refusal(str(was), str(now), payload.get("config", {}))  # --packing alone
        if key == "data_format" and (named_format := format_difference(str(was), str(now), payload, self.cfg)):
            return named_format
        if key == "objective" and objective_name(was) != objective_name(now):  # the rest follows from it
            return f"--objective: checkpoint {objective_name(was)} vs now {objective_name(now)}"
        config = payload.get("config", {})
        then = config.get("context_parallel", 1)
        if key == "global_batch_size" and then != self.cfg.context_parallel:  # a context group trains one row
            return (
                f"{key}: checkpoint {was!r} vs now {now!r} (--context-parallel {then} then, "
                f"{self.cfg.context_parallel} now: the processes of a context group share a row; "
                f"--global-batch-size {was} keeps the run's batch)"
            )
        if key == "epoch_blocks":
            return (
                f"the train data make {now} blocks (pairs, prompts) per epoch where the checkpoint's run made {was}, "
                "with the same files and settings: this version of fsdp_train.py tokenises, skips or packs them "
                "otherwise (the log's skip counts say which), so the saved data position would not be exact; resume "
                "with the version that wrote it, or pass --force-resume to go on from about there"
            )
        if key == "global_batch_size":  # processes x batch x accumulation: another process count, most often
            ranks = max(1, self.d.world_size // max(1, self.d.context_size)) if self.d is not None else 1
            return f"{key}: checkpoint {was!r} vs now {now!r} ({keep_batch_hint(int(was), ranks, self.cfg.batch_size)})"
        if key == "dataset":  # the same -d: what else shapes the data, or the files themselves
            shaping = [
                f"--{k.replace('_', '-')}: checkpoint {config[k]!r} vs now {getattr(self.cfg, k)!r}"
                for k in ("data_slice", "data_weights", "text_column")
                if k in config and config[k] != getattr(self.cfg, k)
            ]
            why = "; ".join(shaping) or "the same -d: its files changed since the checkpoint"
            return f"{key}: checkpoint {was!r} vs now {now!r} ({why})"
        if key == "objective" and isinstance(was, dict) and isinstance(now, dict):
            return objective_difference(was, now, {"rewards": edited_rewards(was.get("rewards"), now.get("rewards"))})
        if key == "peft" and isinstance(was, dict) and isinstance(now, dict):
            return adapter_difference(was, now, config, self.cfg)
        if isinstance(was, dict) and isinstance(now, dict):  # the entries that differ, not two whole dicts
            parts = [
                f"{key}.{k}: checkpoint {was.get(k)!r} vs now {now.get(k)!r}{edited_rewards(was.get(k), now.get(k))}"
                for k in sorted(set(was) | set(now), key=str)
                if was.get(k) != now.get(k)
            ]
            return "; ".join(parts)
        return f"{key}: checkpoint {was!r} vs now {now!r}"

    def check_compatible(self, payload: dict, path: Path, model_config: Any) -> None:
        changed = self.changed_settings(payload, model_config)
        if not changed:
            return
        details = "; ".join(self._difference(k, payload) for k in changed)
        doing = "exporting" if self.cfg.export_only else "resuming from"
        if self.cfg.force_resume:
            log(f"WARNING: {doing} {path} although settings changed ({details}) because of --force-resume")
            return
        if self.cfg.export_only:  # EXPORT_PINNED: each of them would be written into the export (or merged into it)
            raise CheckpointError(
                f"cannot export {path}: {details}. The export would carry them: another tokenizer, or adapters "
                "merged into or pointing at another base. Pass the run's --model-name (its config.yaml has it), "
                "or --force-resume to export with these anyway."
            )
        raise CheckpointError(f"cannot resume from {path}: {details}. {RESUME_REFUSED_FIX}.")

    # -- loading ---------------------------------------------------------------------------------
    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> TrainState:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        payload = self.read_state(path)
        self.check_compatible(payload, path, model.config)
        then, now = payload["fingerprint"].get("start_up_choices"), self.fingerprint.get("start_up_choices")
        if then and now and then != now:
            log(
                f"WARNING: the start-up checks chose {now} where the run that saved {path.name} chose {then} (another "
                "attention kernel installed?): the same math by another route, so the resumed steps may differ from "
                "an uninterrupted run's in the last bits"
            )
        if not self.cfg.export_only and (changed := flags_changed_since(payload.get("config", {}), self.cfg)):
            note = micro_batch_note(model.config, changed)
            log(
                f"resuming with settings changed since {path.name} (they apply from here): {name_sample(changed, 8)}{note}"
            )
        # the flags set the hyperparameters (--weight-decay, ...); the checkpoint restores the optimizer's state only
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
        try:
            if optimizer is None:
                model_sd = get_model_state_dict(model, options=self.options)
                dcp.load({"model": model_sd}, checkpoint_id=str(path), process_group=self.d.cpu_group)
                set_model_state_dict(model, model_sd, options=self.load_options)
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
                dcp.load(
                    {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=self.d.cpu_group
                )
                set_state_dict(
                    model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=self.load_options
                )
                for group, kept in zip(optimizer.param_groups, hyper, strict=True):
                    group.update(kept)
        except CHECKPOINT_FAILURES as exc:
            changed = self.changed_settings(payload, model.config)
            if "model" in changed:  # --force-resume across architectures
                raise CheckpointError(
                    f"checkpoint {path} holds another model ({self._difference('model', payload)}); its weights "
                    "cannot be loaded into this one, even with --force-resume. The checkpoint is intact: rerun with "
                    "its --model-name, or use a new --experiment-name to start this model from scratch."
                ) from exc
            if changed:  # --force-resume across settings that change what is saved (--peft, --lora-rank, ...)
                details = "; ".join(self._difference(k, payload) for k in changed)
                raise CheckpointError(
                    f"checkpoint {path} was saved with other settings ({details}), and its state does not fit this "
                    f"run even with --force-resume ({describe_error(exc)}). The checkpoint is intact, as are the "
                    "earlier ones: rerun with its settings, or use a new --experiment-name for these."
                ) from exc
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({describe_error(exc)}). "
                f"Move that folder aside to resume from the previous checkpoint."
            ) from exc
        rng_file = path / f"rng_rank{self.d.rank:05d}.pt"
        if payload.get("world_size") == self.d.world_size:
            error = _attempt(lambda: _set_rng_state(torch.load(rng_file, weights_only=False)))
            errors: list[str | None] = [None] * self.d.world_size  # every rank stops if any RNG file is bad
            dist.all_gather_object(errors, f"{rng_file}: {error}" if error else None, group=self.d.cpu_group)
            if any(errors):
                raise CheckpointError(
                    "cannot restore the random number generators from "
                    + "; ".join(e for e in errors if e)
                    + ". Move that checkpoint folder aside to resume from the previous one."
                )
        else:
            seed_everything(self.cfg.seed * 1_000_003 + payload["train_state"]["step"] * 101 + self.d.rank)
            log(
                f"world size changed ({payload.get('world_size')} -> {self.d.world_size}): per-rank RNG reseeded "
                f"(only dropout uses it; data order and weights are restored exactly)"
            )
        return TrainState(**payload["train_state"])

    # -- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.cfg.ckpt_freq > 0 and step % self.cfg.ckpt_freq == 0

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, reason: str) -> float:
        """Save (async with --async-ckpt). Returns the seconds training was blocked."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        start = time.perf_counter()
        self.finish_pending()
        final = self.root / step_dir_name(state.step)
        if final.exists():  # already saved at this step (e.g. ckpt-freq step that is also the last)
            return time.perf_counter() - start
        tmp = self.root / f".tmp_{step_dir_name(state.step)}"
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self.d.cpu_group)
        # Files each rank writes alone: agree on their success before entering DCP's collectives, or a rank
        # that failed here would wait in a different collective than the others (a hang, not an error).
        checksums: dict = {}  # of the files this rank writes; rank 0 records everyone's in _commit
        self._agree_or_fail(_attempt(self._write_side_files, tmp, state, checksums), tmp)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        state_dict = {"model": model_sd, "optim": optim_sd}
        writer = _CheckpointWriter(str(tmp), self.d, state.step, checksums)
        fault_point("kill_during_write", self.d, state.step)
        if self.cfg.async_ckpt == "on":
            # Its collectives run in a background thread while the main thread keeps using cpu_group each
            # step; sharing one group would interleave the two streams differently on each rank (a deadlock).
            self.staging = self.staging or host_staging(self.d)
            future = dcp.async_save(
                state_dict, storage_writer=writer, process_group=self.d.async_ckpt_group, async_stager=self.staging
            )
            self.pending = (future, tmp, state.step, checksums)
            error = None
        else:  # DCP gathers a failure on any rank's write and raises it on every rank
            error = _attempt(dcp.save, state_dict, storage_writer=writer, process_group=self.d.cpu_group)
        self._agree_or_fail(error, tmp)
        if self.pending is None:
            self._commit(tmp, state.step, checksums)
        blocked = time.perf_counter() - start
        log(
            f"checkpoint step {state.step} ({reason}) {'queued' if self.pending else 'saved'} "
            f"in {blocked:.2f}s of blocked training -> {self.root / step_dir_name(state.step)}"
        )
        return blocked

    def commit_if_written(self) -> None:
        """--async-ckpt: commit the save in flight as soon as every rank's write is done (checked at each step
        boundary: one CPU-group all-reduce while a save is pending). It waited for the next save, so a kill in
        between fell back one checkpoint more than a synchronous save would."""
        if self.pending is not None and not all_ranks_agree(not self.pending[0].done(), self.d):
            self.finish_pending()

    def finish_pending(self, last: bool = False) -> None:
        """Wait for the async save in flight and commit it; `last` (no more saves): free the staging copy too."""
        if self.pending is not None:
            future, tmp, step, checksums = self.pending
            self.pending = None
            self._agree_or_fail(_attempt(future.result), tmp)
            self._commit(tmp, step, checksums)
        if last and self.staging is not None:
            self.staging.close()
            self.staging = None

    def _write_side_files(self, tmp: Path, state: TrainState, checksums: dict) -> None:
        fault_point("side_files_write", self.d, state.step)
        rng_file = tmp / f"rng_rank{self.d.rank:05d}.pt"
        with open(rng_file, "wb") as fh:
            torch.save(_rng_state(), fh)
            fh.flush()
            os.fsync(fh.fileno())
        checksums[rng_file.name] = file_checksum(rng_file)
        if self.d.is_main:
            payload = {
                "train_state": dataclasses.asdict(state),
                "fingerprint": self.fingerprint,
                "world_size": self.d.world_size,
                "config": run_settings(self.cfg),  # as config.yaml has them: local paths absolute
                "saved_at": dt.datetime.now().isoformat(timespec="seconds"),
                "checksummed": True,  # its checksums.json missing later is damage, not an older version's checkpoint
            }
            write_json_atomic(tmp / "train_state.json", payload)
            checksums["train_state.json"] = file_checksum(tmp / "train_state.json")

    def _agree_or_fail(self, error: BaseException | None, tmp: Path) -> None:
        """Every rank learns whether any rank failed, so a failed write never hangs the others."""
        if all_ranks_agree(error is not None, self.d):
            said = None if error is None else explain_write_error(error, self.root)  # before the space is freed
            if self.d.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            errors: list[str | None] = [None] * self.d.world_size  # rank 0 reports them all, once
            dist.all_gather_object(errors, said, group=self.d.cpu_group)
            where = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(errors) if text)
            previous = self.latest_complete_name()
            raise CheckpointError(
                f"writing checkpoint {tmp.name} failed on {where}. The previous checkpoint "
                f"({previous or 'none'}) is intact; fix the cause (a full disk, a file-size limit: ulimit -f, "
                "permissions) and rerun."
            )

    def latest_complete_name(self) -> str | None:
        complete = step_dirs(self.root)
        return complete[-1].name if complete else None

    def _commit(self, tmp: Path, step: int, checksums: dict) -> None:
        self.checksum_s = checksums.pop("_seconds", 0.0)
        gathered: list[dict | None] = [None] * self.d.world_size
        # Also the barrier that every rank's files are written and fsynced.
        dist.all_gather_object(gathered, checksums, group=self.d.cpu_group)
        fault_point("kill_before_rename", self.d, step)
        if self.d.is_main:
            start = time.perf_counter()
            files = {name: value for part in gathered for name, value in (part or {}).items()}
            files[".metadata"] = file_checksum(tmp / ".metadata")
            write_json_atomic(tmp / CHECKSUM_FILE, {"algorithm": "crc32", "files": files})
            self.checksum_s += time.perf_counter() - start
            final = self.root / step_dir_name(step)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            fault_point("kill_after_rename", self.d, step)
            write_json_atomic(
                self.cfg.experiment_dir / EXPERIMENT_STATE,
                {
                    "latest_checkpoint": str(final),
                    "step": step,
                    "world_size": self.d.world_size,
                    "saved_at": dt.datetime.now().isoformat(timespec="seconds"),
                },
            )
            self._prune()
        dist.barrier(group=self.d.cpu_group)

    def _prune(self) -> None:
        complete = step_dirs(self.root)
        for old in complete[: max(0, len(complete) - self.cfg.keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
            log(f"pruned old checkpoint {old.name} (--keep-last {self.cfg.keep_last})")
