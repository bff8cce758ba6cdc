"""fsdp_train.py: fine-tune any Hugging Face causal LM with PyTorch FSDP2, offline, in one command.

CPU smoke run (gloo, two processes, a tiny model from `model_download.py --init tiny`):

    torchrun --standalone --nproc_per_node 2 fsdp_train.py -e smoke -d hf_datasets/demo -m models/tiny \
        --precision fp32 --seq-length 128 -b 4 --max-steps 50 --log-freq 5

Multi-GPU run (nccl, bf16 compute with fp32 master weights, activation checkpointing):

    torchrun --standalone --nproc_per_node 8 fsdp_train.py -e llama3b-sft -d hf_datasets/my_corpus \
        -m meta-llama/Llama-3.2-3B-Instruct --precision bf16 -b 2 --seq-length 2048 --lr 2e-5 --num-epochs 3

A dataset with a `messages` column (`data_hf.py --format chat`) trains as chat SFT: rendered with the tokenizer's
chat template (or --chat-template FILE), loss on the assistant turns only (--loss-on all for every token).

Rerunning the same command resumes from the newest complete checkpoint in `outputs/EXP/checkpoint/`, also on
another number of GPUs (with --global-batch-size the accumulation adapts).

This file is the recipe, top to bottom: the step (forward_backward, optimizer_step), evaluate, run (config ->
distributed -> data -> model -> resume -> loop -> export, as calls), train_loop and main. Its parts live in
fsdp_lib/: wings (records, data, model, train, and the helper tools' engines) over a ground of small modules,
one concern per module (docs/layout.md).
"""

from __future__ import annotations

from fsdp_lib.interrupts import (  # isort: skip  (no torch)
    exit_without_teardown,
    interrupt_exit_code,
    loading_done,
    stop_while_loading,
)

if __name__ == "__main__":  # Ctrl-C in the seconds torch and transformers take to load: one line, not a traceback
    stop_while_loading("fsdp_train.py")

import contextlib
import math
import signal
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml

from fsdp_lib.checks import launch_world, validate_config
from fsdp_lib.config import TrainConfig, load_config, resolve_precision
from fsdp_lib.data.batch import Batch
from fsdp_lib.data.cache import PackedBlocks, tokenizer_hash
from fsdp_lib.data.chat import export_tokenizer
from fsdp_lib.data.mixture import MixedBlocks
from fsdp_lib.data.plan import Prefetcher, TrainData, build_data, describe_datasets, evaluation_shares, total_steps
from fsdp_lib.errors import CheckpointError, ConfigError, ExperimentLockedError, TrainError, explain_write_error
from fsdp_lib.experiment_dir import run_settings
from fsdp_lib.faults import install_step_hooks
from fsdp_lib.lock import ExperimentLock
from fsdp_lib.model.adapters import export_adapter, merged_state_dict
from fsdp_lib.model.build import ModelBundle, build_model, dry_run, peft_problems
from fsdp_lib.model.float8 import precompute_float8_scales
from fsdp_lib.model.hf_files import model_folder_problems
from fsdp_lib.model.hf_weights import export_hf_model, export_step, warn_stale_export
from fsdp_lib.noise import quiet_optional_imports
from fsdp_lib.offline import resolve_model_dir
from fsdp_lib.runtime import (
    ENV_RANK,
    Dist,
    StopRequest,
    all_ranks_agree,
    clear_stop_request,
    cpu_bf16_warning,
    die_with_launcher,
    eagerly,
    evaluation_cut_short,
    log,
    peer_lost,
    report_error,
    seed_everything,
    setup_distributed,
    stopped_at_once,
)
from fsdp_lib.state import TrainState
from fsdp_lib.train.checkpoint import WRITE_FAILURES, Checkpointer, export_fingerprint, resume_fingerprint
from fsdp_lib.train.checkpoint_verify import latest_intact_checkpoint
from fsdp_lib.train.dpo import step_flops_per_token
from fsdp_lib.train.grpo import check_reward_fit
from fsdp_lib.train.metrics import Metrics, PhaseTimer, plot_metrics, trim_metrics_file
from fsdp_lib.train.objective import Objective, build_objective, needs_starting_weights
from fsdp_lib.train.optim import BadStepGuard, LocalShardAdamW, build_optimizer, global_grad_norm, lr_at
from fsdp_lib.train.profiling import StepProfiler
from fsdp_lib.train.rewards import reward_problems
from fsdp_lib.train.rollout import keep_layers_gathered
from fsdp_lib.train.samples import (
    SAMPLES_FILE,
    SamplePrompt,
    generate_samples,
    load_sample_prompts,
    sample_prompt_problems,
)

# -- the step -------------------------------------------------------------------------------------


def forward_backward(
    train_forward: nn.Module | Objective,
    micro_batches: list[Batch],
    trained_tokens: int,
    guard: BadStepGuard,
    d: Dist,
    timer: PhaseTimer,
    sync_last_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the micro-batches; gradients end up as those of the mean loss over every trained target token of the
    global batch (all micro-batches, all ranks; for DPO: over every pair), plus the MoE router loss where the model
    has one.
    Returns this rank's summed loss and its mean weighted router loss, or None (no sync)."""
    # FSDP averages gradients over the data-parallel ranks, so each rank scales its token sum by world/tokens;
    # trained_tokens is the global batch's count, known on every rank from the data plan.
    loss_scale = d.world_size / max(1, trained_tokens)
    local_sum = torch.zeros((), device=d.device)
    aux_sum = None
    for i, batch in enumerate(micro_batches):
        if sync_last_only:  # --accum-grad-sync last: gradients stay unsharded until the last micro-batch
            train_forward.set_requires_gradient_sync(i == len(micro_batches) - 1)
        with timer.phase("data"):
            batch = batch.to(d.device)
        with timer.phase("forward"):
            loss_sum, aux = train_forward(batch)
        with timer.phase("backward"):
            objective = loss_sum * loss_scale
            if aux is not None:  # like HF's mean loss + coef * aux: averaged over micro-batches (and, by FSDP, ranks)
                objective = objective + aux / len(micro_batches)
                aux_sum = aux.detach() / len(micro_batches) + (0 if aux_sum is None else aux_sum)
            (objective * guard.scale).backward()
        local_sum += loss_sum.detach()
    return local_sum, aux_sum


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, guard: BadStepGuard, cfg: TrainConfig, lr: float
) -> torch.Tensor:
    """Unscale, clip by the global norm across shards, and step, unless the norm is non-finite.

    The skip is decided on the device (fused AdamW's found_inf), so no host sync is needed here.
    Returns the global gradient norm (device tensor)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    norm = global_grad_norm(grads) / guard.scale  # one all-reduce of the local shards' squared norms
    found_inf = (~torch.isfinite(norm)).float()
    coef = 1.0 / guard.scale.to(norm.device)
    if cfg.grad_clip > 0:
        coef = coef * torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if isinstance(optimizer, LocalShardAdamW):  # the unscale and the clip fold into the kernel; a bad step is skipped
        optimizer.grad_scale, optimizer.found_inf = 1.0 / coef, found_inf
        optimizer.step()
    else:
        local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        torch._foreach_mul_(local_grads, coef.to(local_grads[0].device))
        if not bool(found_inf.item()):  # sync: non-fused AdamW cannot skip on device
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    guard.update(found_inf)
    if cfg.fp8 != "off":  # the next all-gathers' float8 scales, from the updated weights
        precompute_float8_scales(model)
    return norm


@torch.no_grad()
def evaluation_totals(
    train_forward: nn.Module, blocks: PackedBlocks, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
) -> tuple[float, int] | None:
    """(loss sum, trained target tokens) of the held-out blocks over all ranks, or None when a stop was requested
    meanwhile (Ctrl-C, SIGTERM: the run saves and exits without waiting for the pass). Every rank runs the same
    number of micro-batches (padded with weight-0 blocks) because FSDP's forward all-gathers must line up across
    ranks."""
    train_forward.eval()
    count = len(blocks) if not cfg.eval_max_blocks else min(len(blocks), cfg.eval_max_blocks)
    totals = torch.zeros(2, device=d.device, dtype=torch.float64)  # loss sum, tokens
    for idx in evaluation_shares(count, cfg.batch_size, d):
        if evaluation_cut_short(stop, d):  # the CPU group: no wait on the GPU
            train_forward.train()
            return None
        real = len(idx)
        idx = idx + [0] * (cfg.batch_size - real)
        batch = blocks.gather(idx).to(d.device)
        batch.labels[real:] = -100  # padding blocks count for nothing
        totals[0] += train_forward(batch)[0].double()
        totals[1] += (batch.labels != -100).sum()
    dist.all_reduce(totals)
    train_forward.train()
    # The ranks of a context group each sum the loss of their part of a block, but count all of its tokens.
    return totals[0].item(), int(totals[1].item()) // d.context_size


def loss_figures(loss_sum: float, tokens: int) -> dict[str, float]:
    """Validation loss weighted by trained target tokens, its perplexity and the token count."""
    loss = loss_sum / tokens if tokens > 0 else float("nan")
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": tokens}


def evaluate(
    train_forward: nn.Module, blocks: PackedBlocks, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
) -> dict[str, float]:
    totals = evaluation_totals(train_forward, blocks, cfg, d, stop)
    return {} if totals is None else loss_figures(*totals)


def evaluate_mixture(
    train_forward: nn.Module, blocks: MixedBlocks, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
) -> dict[str, float]:
    """A mixture's validation: each dataset's held-out loss (val_loss/NAME) and the loss of them all together."""
    totals = {}
    for name, part in zip(blocks.names, blocks.parts):
        if (found := evaluation_totals(train_forward, part, cfg, d, stop)) is None:
            return {}
        totals[name] = found
    figures = loss_figures(sum(s for s, _ in totals.values()), sum(t for _, t in totals.values()))
    for name, (loss_sum, tokens) in totals.items():
        figures.update({f"val_loss/{name}": loss_figures(loss_sum, tokens)["val_loss"], f"val_tokens/{name}": tokens})
    return figures


def validate(
    bundle: ModelBundle,
    objective: Objective | None,
    blocks: PackedBlocks | MixedBlocks,
    cfg: TrainConfig,
    d: Dist,
    stop: StopRequest | None = None,
) -> dict[str, float]:
    """The validation figures: the loss (and perplexity) of the held-out tokens (per dataset too, for a mixture),
    or the objective's (DPO's and KTO's pairs and examples, GRPO's rewards); {} when a stop request cut the pass
    short."""
    with eagerly():  # compiled layers: evaluation's shapes would make the training graph dynamic
        if objective is not None:
            return objective.evaluate(blocks, cfg, d, stop)
        if isinstance(blocks, MixedBlocks):
            return evaluate_mixture(bundle.train_forward, blocks, cfg, d, stop)
        return evaluate(bundle.train_forward, blocks, cfg, d, stop)


def write_samples(
    bundle: ModelBundle,
    prompts: list[SamplePrompt],
    data: TrainData,
    cfg: TrainConfig,
    d: Dist,
    metrics: Metrics,
    step: int,
) -> None:
    """--sample-prompts: greedy completions at this evaluation, generated by every rank on the sharded model."""
    if prompts:
        # with --cpu-offload the shards live in host memory: gathering the whole model for the samples would not
        keep = cfg.cpu_offload == "off" and keep_layers_gathered("auto", bundle.num_params, cfg.precision, d.device)
        with eagerly():  # one token at a time: compiled, every length would be another graph
            rows = generate_samples(
                bundle.train_forward, prompts, cfg.sample_max_new_tokens, data.tokenizer, d.device, keep
            )
        metrics.write_samples(step, rows)


def evaluation_due(cfg: TrainConfig, step: int, last_step: int) -> bool:
    """Every --eval-freq steps, and at the last step."""
    return step == last_step or bool(cfg.eval_freq and step % cfg.eval_freq == 0)


# -- the run --------------------------------------------------------------------------------------


def run(cfg: TrainConfig) -> int:
    precision = resolve_precision(cfg)
    d = setup_distributed(cfg)
    if warning := cpu_bf16_warning(precision, d.device):
        log(warning)
    if cfg.export_only:
        return export_checkpoint(cfg, precision, d)
    stop = StopRequest()
    seed_everything(cfg.seed + d.rank)
    data = build_data(cfg, resolve_model_dir(cfg.model_name), d)
    check_reward_fit(cfg, data)  # --objective grpo: the rewards take the prompts' columns, before the model loads
    latest = latest_intact_checkpoint(cfg.experiment_dir / "checkpoint", d)  # verified before the model loads
    bundle = build_model(
        cfg, precision, d, from_checkpoint=latest is not None and not needs_starting_weights(cfg, data.objective)
    )
    prompts = load_sample_prompts(cfg, data.tokenizer, getattr(bundle.config, "max_position_embeddings", None))
    objective, objective_fingerprint = build_objective(cfg, bundle, data, precision, d)  # DPO, GRPO or None
    optimizer = build_optimizer(bundle.model, cfg)

    fingerprint = resume_fingerprint(cfg, bundle.config, data, bundle.peft, objective_fingerprint, bundle.train_forward)
    checkpointer = Checkpointer(cfg, d, fingerprint)
    state = TrainState()
    if latest is not None:
        state = checkpointer.load(latest, bundle.model, optimizer)
        log(
            f"resumed from {latest} at step {state.step} (epoch {state.epoch}, {state.samples_in_epoch} samples "
            f"into the epoch)"
        )
        if moved := state.fit_epoch(data.train.global_batch, data.train.steps_per_epoch):
            log(moved)
    if d.is_main:  # only now: a refused run writes nothing
        cfg.experiment_dir.mkdir(parents=True, exist_ok=True)
        (cfg.experiment_dir / "config.yaml").write_text(yaml.safe_dump(run_settings(cfg), sort_keys=False))

    steps = range(state.step + 1, total_steps(cfg, data.train) + 1)
    flops = bundle.flops_per_token
    if objective is not None:
        flops = step_flops_per_token(bundle, objective.reference, objective.forwards_without_gradient)
    window_figures = objective.window_figures if objective is not None else None
    metrics = Metrics(cfg, d, data.train, flops, precision, steps, window_figures)
    metrics.resume_window(state.log_window)  # the steps the checkpoint's run trained since its last log line
    if d.is_main:
        for path in (metrics.path, metrics.path.with_name(SAMPLES_FILE)):  # from scratch: no line, not even step 0
            trim_metrics_file(path, state.step if state.step else -1)
    try:
        stop.start_training()  # from here a signal stops at the next step boundary, after a checkpoint
        finished = train_loop(cfg, d, bundle, data, optimizer, checkpointer, metrics, state, stop, objective, prompts)
    finally:
        metrics.close()
        if d.is_main:
            plot_metrics(metrics.path, cfg.experiment_dir / "loss.png", cfg.experiment_name)
    if finished:
        export(bundle, data.tokenizer, cfg, d, state.step)
    return 0


def export_checkpoint(cfg: TrainConfig, precision: str, d: Dist) -> int:
    """--export-only: the newest intact checkpoint exported as the run's end exports it. Nothing trains, so no
    dataset is read (one moved or deleted since the run does not stop its export) and no objective or reward is
    built; the model, its tokenizer and adapters must be the run's."""
    model_dir = resolve_model_dir(cfg.model_name)
    latest = latest_intact_checkpoint(cfg.experiment_dir / "checkpoint", d, export=True)
    if latest is None:
        raise CheckpointError(f"--export-only: no complete checkpoint in {cfg.experiment_dir / 'checkpoint'}")
    bundle = build_model(cfg, precision, d, from_checkpoint=True, probes=False)
    checkpointer = Checkpointer(cfg, d, export_fingerprint(cfg, bundle.config, tokenizer_hash(model_dir), bundle.peft))
    tokenizer = export_tokenizer(cfg, model_dir, checkpointer.read_state(latest)["fingerprint"])
    state = checkpointer.load(latest, bundle.model, None)
    log(f"--export-only: exporting {latest} (step {state.step})")
    export(bundle, tokenizer, cfg, d, state.step)
    return 0


def export(bundle: ModelBundle, tokenizer: Any, cfg: TrainConfig, d: Dist, step: int) -> None:
    """outputs/EXP/final: a standard Hugging Face folder of the trained model, its tokenizer and chat template;
    with --peft a PEFT adapter folder instead (and with --export-merged on, outputs/EXP/final-merged)."""
    final = cfg.experiment_dir / "final"
    if (held := export_step(final)) is not None and held > step:  # its checkpoint damaged or pruned: keep the newer
        raise CheckpointError(
            f"{final} holds the export of step {held}, newer than step {step}, the newest intact checkpoint: not "
            f"replaced (it may be the only copy of step {held}). To export step {step} anyway, move {final} aside first"
        )
    if bundle.peft is None:
        export_hf_model(bundle.model, tokenizer, final, d, bundle.export_dtype, bundle.model_dir, step)
        return
    export_adapter(bundle.model, bundle.peft.config, tokenizer, final, d, bundle.peft.base_identity, step)
    merged_dir = final.with_name("final-merged")
    if cfg.export_merged == "on":
        merged = merged_state_dict(bundle.model, bundle.export_dtype)
        export_hf_model(bundle.model, tokenizer, merged_dir, d, bundle.export_dtype, bundle.model_dir, step, merged)
    elif merged_dir.is_dir():
        warn_stale_export(merged_dir, step)


def evaluation_point(
    bundle: ModelBundle,
    objective: Objective | None,
    data: TrainData,
    cfg: TrainConfig,
    d: Dist,
    metrics: Metrics,
    prompts: list[SamplePrompt],
    step: int,
    epoch: float,
    stop: StopRequest | None,
) -> None:
    """The validation figures and the samples of this step; a stop request (stop: None = never) cuts the pass
    short, leaves out its figures and skips the samples, which wait for the next evaluation."""
    if data.validation is not None and (result := validate(bundle, objective, data.validation, cfg, d, stop)):
        metrics.write({"step": step, "epoch": epoch, **result})
    if prompts and (stop is None or not all_ranks_agree(stop.requested, d)):
        write_samples(bundle, prompts, data, cfg, d, metrics, step)


def train_loop(
    cfg: TrainConfig,
    d: Dist,
    bundle: ModelBundle,
    data: TrainData,
    optimizer: torch.optim.Optimizer,
    checkpointer: Checkpointer,
    metrics: Metrics,
    state: TrainState,
    stop: StopRequest,
    objective: Objective | None = None,
    prompts: list[SamplePrompt] | None = None,
) -> bool:
    """Returns True when training ran to the end, False when it stopped on a signal (after saving).
    objective: --objective dpo's or grpo's, called per micro-batch in place of the language-model loss; prompts: those of
    --sample-prompts, completed at every evaluation."""
    prompts = prompts or []
    plan, last_step = data.train, total_steps(cfg, data.train)
    step_forward = objective or bundle.train_forward
    guard = BadStepGuard(state, d.device, resolve_precision(cfg), cfg.max_bad_steps)
    install_step_hooks(bundle.train_forward, optimizer, state, d)  # test-only faults; nothing unless asked for
    prefetch = Prefetcher(plan, pin=d.device.type == "cuda")
    if cfg.fp8 != "off":  # from the weights as built or resumed: a resumed step scales as the uninterrupted one
        precompute_float8_scales(bundle.model)
    sync_last_only = cfg.accum_grad_sync == "last" and cfg.grad_accum_steps > 1
    if state.step >= last_step:
        log(
            f"the checkpoint is at step {state.step}, at or past the last step {last_step}; nothing to train (raise "
            "--max-steps or --num-epochs to go on)"
        )
    else:
        log(f"training steps {state.step + 1}..{last_step} ({plan.steps_per_epoch} per epoch)")
        if cfg.max_steps > last_step:  # the data runs out first: said, so a run does not stop short unexplained
            log(
                f"WARNING: --max-steps {cfg.max_steps} is more than --num-epochs {cfg.num_epochs} x "
                f"{plan.steps_per_epoch} steps per epoch: training stops at step {last_step}; raise --num-epochs to "
                f"reach step {cfg.max_steps}"
            )
    if state.step == 0 and cfg.eval_at_start == "on":  # step 0: the base model, to compare the fine-tuned one with
        evaluation_point(bundle, objective, data, cfg, d, metrics, prompts, 0, 0.0, stop)
        if all_ranks_agree(stop.requested, d):  # nothing has trained: no step to take, no checkpoint to write
            log("stopped on request before the first step; nothing was trained or saved: rerun the same command")
            return False
    grad_norm, said_empty = torch.zeros(()), False
    with StepProfiler(cfg, d, state.step + 1, last_step) as profiler:  # --profile-steps; nothing unless asked for
        while state.step < last_step:
            profiler.step_begins(state.step + 1)
            with metrics.timer.phase("data"):
                step_in_epoch = state.samples_in_epoch // plan.global_batch
                micro_batches, trained = prefetch.get(state.epoch, step_in_epoch)
                sources = prefetch.sources(state.epoch, step_in_epoch)
            if objective is not None and objective.phase:  # GRPO samples the completions, KTO measures its z
                with metrics.timer.phase(objective.phase):
                    micro_batches, trained = objective.begin_step(micro_batches, trained, state.epoch)
            lr = lr_at(state.step, cfg, last_step)
            updates = objective.updates if objective is not None else 1  # GRPO's --num-iterations: several
            step_loss, norms, aux_loss = torch.zeros((), device=d.device), [], None
            if not trained and not said_empty:  # no update: AdamW's momentum and decay would move the weights
                log(f"step {state.step + 1}: no target of its global batch carries loss, so no update (nor at later "
                    "such steps, which metrics.jsonl shows with loss and grad_norm null)")  # fmt: skip
                said_empty = True
            for update in range(updates if trained else 0):
                if update:
                    objective.next_update()
                loss_sum, aux_loss = forward_backward(
                    step_forward, micro_batches, trained, guard, d, metrics.timer, sync_last_only
                )
                with metrics.timer.phase("update"):
                    norms.append(optimizer_step(bundle.model, optimizer, guard, cfg, lr))
                step_loss += loss_sum
            grad_norm = torch.stack(norms) if norms else torch.zeros(1, device=d.device)  # one per update
            state.advance(plan.global_batch, plan.steps_per_epoch)
            profiler.step_ended(state.step)

            stats = objective.take_stats() if objective else None
            metrics.record(
                step_loss, trained * updates, aux_loss, stats, sources, micro_batches
            )  # the loss: its updates' mean
            if metrics.due(state.step) or state.step == last_step:
                metrics.emit(state, lr, grad_norm, guard.sync(state))
                if objective is not None:  # GRPO: one prompt's completions and their rewards
                    metrics.write_samples(state.step, objective.take_samples())
            if evaluation_due(cfg, state.step, last_step):
                final = state.step == last_step  # its figures and samples are never made up later: not cut short
                epoch = metrics.epoch_progress(state)
                evaluation_point(
                    bundle, objective, data, cfg, d, metrics, prompts, state.step, epoch, None if final else stop
                )

            checkpointer.commit_if_written()  # --async-ckpt: a save whose writes are done is committed now
            interrupted = all_ranks_agree(stop.requested or metrics.failure is not None, d)
            if interrupted or checkpointer.due(state.step):
                guard.sync(state)
                state.log_window = metrics.carried_window()
                checkpointer.save(bundle.model, optimizer, state, "signal" if interrupted else "periodic")
            if interrupted:
                checkpointer.finish_pending(last=True)
                metrics.stop_if_failed()
                log(f"stopped at step {state.step} on request; rerun the same command to resume")
                return False
    guard.sync(state)
    state.log_window = metrics.carried_window()  # None: the last step is always logged
    checkpointer.save(bundle.model, optimizer, state, "final")
    checkpointer.finish_pending(last=True)
    return True


def stopped_now(interrupt: KeyboardInterrupt, cut: str = "") -> int:
    """The one line of a stop at once, by the signal `interrupt` names, and its exit code (128 + the signal)."""
    by = "SIGTERM" if interrupt.args == ("SIGTERM",) else "Ctrl-C"
    log(f"stopped at once by {by}, without saving{cut}; rerun the same command to resume from the newest checkpoint")
    return interrupt_exit_code(interrupt)


def main(argv: list[str] | None = None) -> int:
    loading_done()
    die_with_launcher()
    try:
        cfg = load_config(argv)
        if cfg.peft != "qlora":  # torchao is QLoRA's; its import-time warnings are noise to everyone else
            quiet_optional_imports()
        lock = ExperimentLock(cfg.experiment_dir)
        if ENV_RANK == 0:  # the other ranks would see rank 0's own lock; torchrun stops them if rank 0 exits
            lock.check_free()  # a launch on a busy experiment fails in seconds, before the slower validation
        problems = validate_config(cfg, launch_world(cfg))
        problems = problems or peft_problems(cfg)  # the adapter flags against the model, built on meta
        if not cfg.export_only:  # the reward files are imported here; an export needs none
            problems = problems or reward_problems(cfg.reward, cfg.reward_weights, cfg.reward_pattern)
        if not problems:
            model_dir = resolve_model_dir(cfg.model_name)
            # the files whole and the vocabulary fitting, then the sample prompts rendered and fitting
            problems = model_folder_problems(model_dir) or sample_prompt_problems(cfg, model_dir)
        if problems:
            raise ConfigError(problems)
    except ConfigError as exc:
        return report_error(str(exc), 2)
    except ExperimentLockedError as exc:
        return report_error(str(exc), 1)
    except KeyboardInterrupt:
        log("stopped by Ctrl-C while checking the run's settings; nothing was written")
        return 130
    at_once = False
    try:
        if cfg.dry_run:
            describe_datasets(cfg, resolve_model_dir(cfg.model_name))
            return dry_run(cfg, launch_world(cfg))
        if ENV_RANK == 0:  # before any process group, so a refused launch touches nothing
            lock.acquire()
        return run(cfg)
    except KeyboardInterrupt as interrupt:  # a signal before training, or a second Ctrl-C (StopRequest): stop now
        at_once = True
        return stopped_now(interrupt)
    except (Exception, *WRITE_FAILURES) as exc:  # DCP's CheckpointException is a BaseException
        if signum := stopped_at_once():  # it cut a save or a collective short, here or on a peer: not a fault
            at_once = True
            cut = f" (what it cut short ended in {type(exc).__name__})"
            return stopped_now(KeyboardInterrupt(signal.Signals(signum).name), cut)
        if isinstance(exc, (TrainError, FileNotFoundError)):
            return report_error(str(exc), 1)
        if peer_lost(exc):  # its peers are gone: no teardown collective either
            at_once = True
            return report_error(
                f"another process of this launch stopped (killed, or out of memory: torchrun's summary names which) "
                f"while this one waited on it ({str(exc).splitlines()[0][:200]}); the checkpoints already written are "
                "whole: rerun the same command to resume",
                1,
            )
        if isinstance(exc, WRITE_FAILURES):  # e.g. a read-only or full --save-dir: the OS error in words, with the path
            return report_error(
                f"{explain_write_error(exc, cfg.experiment_dir.parent)}; fix it and rerun the same command", 1
            )
        raise
    finally:
        lock.release()
        clear_stop_request()
        if ENV_RANK == 0:  # a run refused before it wrote anything leaves no empty experiment folder
            with contextlib.suppress(OSError):
                cfg.experiment_dir.rmdir()
        if dist.is_initialized() and not at_once:  # after a second Ctrl-C the peers may be gone mid-collective
            dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: an unexpected exception becomes torchrun's root cause, not "see docs"; a return ends the process
    # without the interpreter's second-long teardown
    exit_without_teardown(record(main)())
