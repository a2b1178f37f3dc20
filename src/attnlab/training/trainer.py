"""The training loop: Adam with a warm-up schedule, label smoothing, clipping, checkpoints, resume
(written and restored by :mod:`attnlab.training.checkpointing`; the checks before it: :mod:`attnlab.training.checks`).

One call, :func:`train`, does a whole run:

1. build the task, then the model the task calls for (its vocabulary sizes come from the task);
2. Adam (Vaswani §5.3), the LR schedule, label smoothing (§5.4), gradient clipping;
3. every ``log_every`` steps a line in ``metrics.jsonl`` (the mean loss of the steps since the last
   line; ``examples_per_s`` for a classifier, ``tokens_per_s`` otherwise); every ``eval_every`` steps
   an evaluation; every ``checkpoint_every`` steps (and at the end) an atomic checkpoint, which
   records the validation of its step when there was one (``eval --checkpoint best``); the final
   evaluation says whether the model fit its training split (:mod:`attnlab.evaluation.fit`), and
   records the training split's statistics (a ``train`` record: distinct strings, and for the bracket
   languages the depth range of its members), every length and depth bin, and the generalisation
   horizon over the length bins (a ``length_bins`` record, :mod:`attnlab.evaluation.horizon`); with
   ``train.log_to = ["jsonl", "tensorboard"]`` every record also goes to TensorBoard event files in
   RUN/tensorboard/, with attention heatmaps at each validation (:mod:`attnlab.training.tensorboard_log`);
4. a NaN or Inf loss stops the run with the step named; the last good checkpoint stays;
5. ``resume=True`` restores weights, optimizer, schedule, RNG and data position, so the losses
   after the resume equal those of an uninterrupted run (bit for bit on the CPU);
6. with ``train.stop_at_accuracy`` the run stops at the evaluation whose mean accuracy reaches it;
   with ``train.select = "best_valid"`` the final evaluation scores the weights of the best
   validation; with ``train.oracle`` each evaluation also scores the length bins, and the best per
   bin goes to RUN/oracle.json, marked as selected on the test bins (:mod:`attnlab.training.selection`).
   The last checkpoint always holds the last step's weights;
7. with ``task.fresh_examples`` each batch is drawn afresh (:class:`attnlab.training.data.FreshStream`).

With several processes (torchrun) the model is wrapped in DistributedDataParallel and only rank 0
writes anything.

While it trains, rank 0 holds the run's writer lock (:mod:`attnlab.run.lock`): a second writer of the
same run directory is refused, naming this process. The run trains on ``train.threads`` threads,
recorded in config.json, and each checkpoint records the platform; a resume on another one warns
(:mod:`attnlab.training.reproducibility`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from attnlab import devices
from attnlab.embeddings import init_embedding, load_vectors
from attnlab.errors import EXIT_DIVERGED, AttnlabError, ConfigError
from attnlab.evaluation.evaluate import evaluate
from attnlab.evaluation.fit import training_fit
from attnlab.evaluation.horizon import chained_horizon
from attnlab.evaluation.objectives import OBJECTIVES
from attnlab.experiment import ExperimentConfig, TrainConfig, model_for_task, positions_seed
from attnlab.head_ids import held_mask
from attnlab.kernels import native
from attnlab.nn import InputEmbedding, masking_heads
from attnlab.run.directory import RunDir, validation_record
from attnlab.run.loaded import saved_tokenizer
from attnlab.tasks.base import split_statistics
from attnlab.tasks.codec import TextCodec
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import Tokenizer
from attnlab.training.checkpointing import (
    fall_back_to_good_checkpoint,
    remove_if_unused,
    restore_checkpoint,
    run_directory,
    write_checkpoint,
)
from attnlab.training.checks import check_log_targets, check_loss, check_resources, check_splits
from attnlab.training.data import BatchStream, FreshStream
from attnlab.training.distributed import DistInfo, all_reduce_sum, broadcast_from_main, from_environment, shutdown
from attnlab.training.plots import plot_accuracy_by_length, plot_curves
from attnlab.training.reproducibility import applied_threads, platform_record, run_kernels
from attnlab.training.schedule import make_scheduler
from attnlab.training.selection import ORACLE_LABEL, Evaluation, Selection, oracle_report, select, stop_reached
from attnlab.training.step_log import LogWindow, StepOutcome, describe_split, rate_key
from attnlab.training.tensorboard_log import MetricSink, attention_sample, open_sink

__all__ = [
    "TrainingDiverged",
    "TrainResult",
    "train",
    "resolve_device",
    "make_optimizer",
]

Log = Callable[[str], None]


class TrainingDiverged(AttnlabError):
    """The loss became NaN or Inf."""

    exit_code = EXIT_DIVERGED


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports."""

    run: Path
    step: int
    losses: list[float]
    final_metrics: dict[str, Any] | None


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a :class:`torch.device` (:func:`attnlab.devices.resolve_device`); a malformed
    name, or a GPU this process cannot see, is a ConfigError naming train.device."""
    try:
        return devices.resolve_device(name)
    except ValueError as error:
        raise ConfigError(f"train.device: {error}") from None


def make_optimizer(parameters: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam (Vaswani §5.3), or AdamW with weight decay, in PyTorch's fused implementation (one kernel
    for all parameters, faster than the multi-tensor one on a CPU; benchmarks/README.md)."""
    options = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    if cfg.weight_decay > 0:
        return torch.optim.AdamW(parameters, weight_decay=cfg.weight_decay, **options)
    return torch.optim.Adam(parameters, **options)


def train(
    experiment: ExperimentConfig,
    run_path: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    log: Log | None = None,
    like: str | Path | None = None,
) -> TrainResult:
    """Train (or resume) the run at ``run_path``; ``like``: a run whose kernel choices to repeat."""
    dist = from_environment(experiment.train.device)
    path = Path(run_path)
    new_folder = not resume and dist.is_main and not path.exists()
    run = None
    try:
        run = run_directory(path, resume=resume, dist=dist)
        with run.lock(enabled=dist.is_main), applied_threads(experiment.train.threads) as threads:
            experiment = dataclasses.replace(experiment, train=dataclasses.replace(experiment.train, threads=threads))
            result = _Trainer(experiment, run, resume=resume, dist=dist, progress=progress, log=log, like=like).fit()
    except BaseException:
        if new_folder and run is not None:
            remove_if_unused(run)  # a refused config (memory, batch size, ...) leaves nothing behind
        shutdown(dist)  # without waiting: a failed peer never reaches the barrier
        raise
    shutdown(dist, wait_for_peers=True)
    return result


ORACLE_FILE = "oracle.json"
"""The oracle report of ``train.oracle`` in the run folder (:func:`attnlab.training.selection.oracle_report`)."""


class _Trainer:
    def __init__(
        self,
        experiment: ExperimentConfig,
        run: RunDir,
        *,
        resume: bool,
        dist: DistInfo,
        progress: bool,
        log: Log | None,
        like: str | Path | None = None,
    ) -> None:
        cfg = self.cfg = experiment.train
        check_log_targets(cfg)  # a missing package is a ConfigError before anything is built or written
        self.experiment, self.dist, self.progress = experiment, dist, progress
        self.log = log if (log is not None and dist.is_main) else (lambda message: None)
        self.device = resolve_device(
            cfg.device if not dist.enabled or cfg.device == "cpu" else f"cuda:{dist.local_rank}"
        )
        self.run = run
        self.platform = platform_record(cfg.threads)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.task, self.tokenizer = self._build_task(resume)
        self.train_examples = train_examples = self.task.split("train")
        available = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        check_resources(experiment, self.task, train_examples, available=available)  # before the model exists
        check_splits(self.task, cfg.final_splits)  # ... or a file is written
        check_loss(cfg.loss, self.task)
        self.log(describe_split("train", split_statistics(train_examples)))
        self._report_skipped_lines()
        self.model = model_for_task(experiment, self.task).to(self.device)
        self.kernels = run_kernels(self.model, experiment, run, resume=resume, like=like)  # kernels.json
        self.max_length = cfg.max_length or self.model.config.max_len
        self.optimizer = make_optimizer(self.model.parameters(), cfg)
        self.scheduler = make_scheduler(self.optimizer, cfg.schedule, warmup=cfg.warmup, total=cfg.steps)
        stream_options = dict(
            pad_id=self.task.pad_id,
            bos_id=self.task.bos_id,
            eos_id=self.task.eos_id,
            seed=cfg.seed,
            max_length=self.max_length,
            truncate=cfg.truncate,
            dist=dist,
        )
        # task.fresh_examples: a new batch from the task at every step; else epochs of the train split
        self.stream: BatchStream | FreshStream = (
            FreshStream(self.task, cfg.batch_size, **stream_options)
            if getattr(self.task, "fresh_examples", False)
            else BatchStream(train_examples, cfg.batch_size, **stream_options)
        )
        self.step = 0
        self.validation: dict[str, Any] | None = None  # the latest validation of this session
        self.history: list[Evaluation] = []  # the evaluations during training (selection, oracle, stop)
        self.stopped: dict[str, Any] | None = None  # the stop record once train.stop_at_accuracy is reached
        self.selected_weights: dict[str, torch.Tensor] | None = None  # best_valid: the best evaluation's
        self.final: Selection | None = None  # set for the end-of-training evaluation
        self.oracle: dict[str, Any] = {}  # bin -> its oracle fields, at the end
        if resume:  # the run's latest checkpoint (attnlab.training.checkpointing)
            resumed = restore_checkpoint(
                self.run,
                self.model,
                self.optimizer,
                self.scheduler,
                self.stream,
                platform=self.platform,
                main=dist.is_main,
            )
            self.step, self.history, self.stopped = resumed.step, resumed.history, resumed.stopped
            self.selected_weights = resumed.selected_weights
            self.log(f"resumed {self.run.path} at step {self.step}")
        else:
            self._initialise_embeddings()
            if dist.is_main:
                self.run.write_config(experiment.to_dict())
                if self.tokenizer is not None:
                    self.run.write_tokenizer(self.tokenizer.to_json())
        self.objective = partial(OBJECTIVES[experiment.model_kind], loss=cfg.loss)
        self.head_mask = held_mask(self.model, cfg.mask_heads)  # xi_h = 0 for the held heads (Michel §2.3)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.trained: nn.Module = self._distributed(self.model)
        self.sink: MetricSink = self._metric_sink(resume)  # last: nothing after it can fail and leave it open

    # ---- set-up ------------------------------------------------------------------------------

    def _build_task(self, resume: bool) -> tuple[Any, Tokenizer | None]:
        """The task, and the tokenizer every rank encodes with: rank 0's. Training one per rank
        would not do: Hugging Face's WordPiece trainer can learn different pieces from the same
        corpus on each call (it breaks ties between merges in hash-map order; tokenizers#1794)."""
        if not self.dist.enabled:
            return build_task(self.experiment.task, saved_tokenizer=self._saved_tokenizer(resume))
        if self.dist.is_main:
            try:
                task, tokenizer = build_task(self.experiment.task, saved_tokenizer=self._saved_tokenizer(resume))
            except Exception as error:
                broadcast_from_main({"error": str(error)}, self.dist)  # the other ranks must not wait forever
                raise
            broadcast_from_main({"tokenizer": None if tokenizer is None else tokenizer.hf.to_str()}, self.dist)
            return task, tokenizer
        sent = broadcast_from_main(None, self.dist)
        if "error" in sent:
            raise ConfigError(f"rank 0 could not build the task: {sent['error']}")
        if sent["tokenizer"] is None:
            return build_task(self.experiment.task)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "tokenizer.json"
            path.write_text(sent["tokenizer"], encoding="utf-8")
            return build_task(self.experiment.task, saved_tokenizer=path)

    def _saved_tokenizer(self, resume: bool) -> Tokenizer | None:
        """On resume, the run's tokenizer.json, verified against its manifest."""
        return saved_tokenizer(self.run) if resume else None

    def _report_skipped_lines(self) -> None:
        """With ``task.skip_bad_lines`` nothing is dropped silently: say how many lines were skipped."""
        skipped = getattr(self.task, "skipped", lambda: ())()
        if skipped:
            self.log(f"skipped {len(skipped)} bad lines (task.skip_bad_lines = true); first: {skipped[0]}")

    def _initialise_embeddings(self) -> None:
        """Copy word vectors into every token embedding of the model (same seed on every rank)."""
        if not self.cfg.init_embeddings:
            return
        vectors = load_vectors(self.cfg.init_embeddings)
        vocabulary = TextCodec(self.task, self.tokenizer).vocabulary()
        for name, module in self.model.named_modules():
            if isinstance(module, InputEmbedding):
                coverage = init_embedding(module.token, vocabulary, vectors)
                self.log(f"{name}: {coverage}")
                if self.dist.is_main:
                    self.run.append_metrics(
                        {
                            "step": 0,
                            "embedding": name,
                            "found": coverage.found,
                            "total": coverage.total,
                            "coverage": coverage.ratio,
                        }
                    )

    def _metric_sink(self, resume: bool) -> MetricSink:
        """Where the records go besides metrics.jsonl (``train.log_to``; rank 0 only). A resumed run
        appends to the same TensorBoard folder, hiding what was logged after the checkpoint."""
        codec = TextCodec(self.task, self.tokenizer)
        options = dict(model_kind=self.experiment.model_kind, max_length=self.max_length, truncate=self.cfg.truncate)
        return open_sink(
            self.cfg.log_to if self.dist.is_main else (),
            self.run.path,
            sample=lambda: attention_sample(self.task, codec, **options),
            purge_step=self.step + 1 if resume else None,
        )

    def _distributed(self, model: nn.Module) -> nn.Module:
        if not self.dist.enabled:
            return model
        config = self.model.config
        # hard attention without straight-through gives W_Q, W_K no gradient at all
        unused = config.attention == "hard" and not config.straight_through
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=unused)

    # ---- the loop ----------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        """Train (:meth:`_fit`), then close the metric sink, also when training fails."""
        try:
            return self._fit()
        finally:
            self.sink.close()

    def _fit(self) -> TrainResult:
        """Train to ``train.steps``; log, evaluate and checkpoint on schedule; evaluate at the end.

        Each logged ``loss`` is the mean of the per-step losses since the previous log (each step's
        loss being its batch's mean over the tokens or examples it predicts), not the last batch's:
        batches are grouped by length, so one batch can be far from the run's average. The rate is
        ``examples_per_s`` for a classifier (one prediction per example), ``tokens_per_s`` otherwise.
        The final evaluation also says whether the model fit its training split
        (:func:`attnlab.evaluation.fit.training_fit`).
        """
        cfg = self.cfg
        losses: list[float] = []
        native.prepare(self.device)  # a first use's kernel build before the bar, not in its first step
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", disable=not (self.progress and self.dist.is_main))
        window = LogWindow(rate_key=rate_key(self.experiment.model_kind))
        final_metrics = None
        while self.step < cfg.steps and self.stopped is None:
            outcome = self._train_step()
            losses.append(outcome.loss)
            window.add(outcome)
            bar.update(1)
            if self._due(cfg.log_every):
                record = {"step": self.step, **window.record(), "lr": outcome.lr, "epoch": self.stream.position.epoch}
                self._write_metrics(record)
                rate = "ex_s" if window.rate_key == "examples_per_s" else "tok_s"
                bar.set_postfix(
                    {
                        "loss": f"{record['loss']:.4f}",
                        "lr": f"{record['lr']:.2e}",
                        rate: f"{record[window.rate_key]:.0f}",
                    }
                )
                window = LogWindow(rate_key=window.rate_key)
            if self._due(cfg.eval_every) and self.step < cfg.steps:
                self._evaluate_during_training()
            if self._due(cfg.checkpoint_every) and self.step < cfg.steps and self.stopped is None:
                self._checkpoint()
        bar.close()
        if self.dist.is_main:
            last_weights = self._load_selected()
            final_metrics = self._evaluate("valid", fit=True)  # before the checkpoint, which records it
            self._record_training_split()
            finals = {name: self._evaluate(name) for name in cfg.final_splits}
            self._evaluate_length_bins(finals.get("length_generalisation"))
            self._evaluate_depth_bins()
            if last_weights is not None:
                self.model.load_state_dict(last_weights)  # the checkpoint holds the last step's weights
            self._write_oracle()
        self._checkpoint()
        return TrainResult(self.run.path, self.step, losses, final_metrics)

    # ---- evaluations during training: selection, stop, oracle (train.select, stop_at_accuracy, oracle)

    def _evaluate_during_training(self) -> None:
        """Score ``valid``, and every length bin too with ``train.oracle`` or ``train.stop_at_accuracy``;
        keep the evaluation (and, with ``best_valid``, the weights of the best one); stop once the
        mean accuracy reaches ``train.stop_at_accuracy``. Rank 0 decides; every rank learns of a stop."""
        cfg = self.cfg
        if self.dist.is_main:
            names = ["valid"]
            if cfg.oracle or cfg.stop_at_accuracy > 0:
                names += list(getattr(self.task, "length_bins", {}))
            results = {name: self._evaluate(name) or {} for name in names}
            scored = {name: result for name, result in results.items() if result.get("examples")}
            evaluation = Evaluation(
                self.step,
                {name: float(r["accuracy"]) for name, r in scored.items()},
                {name: float(r["loss"]) for name, r in scored.items()},
            )
            self.history.append(evaluation)
            if cfg.select == "best_valid" and select(cfg.select, self.history, self.step).step == self.step:
                self.selected_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            mean = stop_reached(evaluation, cfg.stop_at_accuracy) if cfg.stop_at_accuracy > 0 else None
            if mean is not None:
                self.stopped = {
                    "step": self.step,
                    "stopped_early": True,
                    "stop_at_accuracy": cfg.stop_at_accuracy,
                    "mean_accuracy": mean,
                    "stop_splits": ", ".join(evaluation.accuracy),
                }
                self._write_metrics(self.stopped)
                self.log(f"stopped at step {self.step}: mean accuracy {mean:.4f} >= {cfg.stop_at_accuracy}")
        self.stopped = broadcast_from_main(self.stopped, self.dist)

    def _load_selected(self) -> dict[str, torch.Tensor] | None:
        """Choose the weights the final evaluation scores (``train.select``) and load them; returns
        the last step's weights to put back afterwards, or None when the last ones were chosen."""
        history = list(self.history)
        if self.cfg.select == "best_valid" and (not history or history[-1].step != self.step):
            result = evaluate(self.model, self.task, "valid", **self._evaluation_options())  # the last weights too
            history.append(Evaluation(self.step, {"valid": result["accuracy"]}, {"valid": result["loss"]}))
        self.final = select(self.cfg.select, history, self.step)
        self.log(f"final evaluation: step {self.final.step}'s weights, {self.final.reason}")
        if self.final.step == self.step or self.selected_weights is None:
            return None
        last = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.selected_weights)
        return last

    def _final_fields(self, split: str, result: dict[str, Any]) -> dict[str, Any]:
        """What an end-of-training record adds: the selection (all of it on ``valid``, the step
        elsewhere), and on a length bin with ``train.oracle`` the bin's oracle figure, labelled."""
        assert self.final is not None
        fields = self.final.record() if split == "valid" else {"selected_step": self.final.step}
        if self.cfg.oracle and split in getattr(self.task, "length_bins", {}) and result.get("examples"):
            history = list(self.history)
            if self.final.step == self.step:  # the last step's weights: one more evaluated step
                history.append(Evaluation(self.step, {split: float(result["accuracy"])}, {}))
            best = oracle_report(history, [split])["bins"][split]
            self.oracle[split] = best
            fields.update(oracle_accuracy=best["accuracy"], oracle_step=best["step"], oracle_selected_on=ORACLE_LABEL)
        return fields

    def _write_oracle(self) -> None:
        """RUN/oracle.json: the oracle figure of every length bin (``train.oracle``)."""
        if not self.cfg.oracle:
            return
        steps = sorted(
            {e.step for e in self.history} | ({self.step} if self.final and self.final.step == self.step else set())
        )
        report = oracle_report([], [])
        report.update(evaluations=len(steps), steps=steps, bins=self.oracle)
        (self.run.path / ORACLE_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _train_step(self) -> StepOutcome:
        cfg = self.cfg
        self.trained.train()
        batch = self.stream.next().to(self.device)
        with self._autocast():
            with masking_heads(self.model, self.head_mask):  # the held heads' xi = 0, on the model under any wrapper
                parts = self.objective(self.trained, batch, None, self.task.pad_id, cfg.label_smoothing)
        global_count = all_reduce_sum(parts.count.to(torch.float64), self.dist)
        global_total = all_reduce_sum(parts.total.detach().to(torch.float64), self.dist)
        mean_loss = float(global_total / global_count.clamp_min(1))
        if not torch.isfinite(global_total):
            kept = fall_back_to_good_checkpoint(self.run, self.step) if self.dist.is_main else "see the main process"
            raise TrainingDiverged(f"the loss became {mean_loss} at step {self.step + 1}; {kept}")
        # Each rank's sum over the global count, times N: DDP's average over ranks is the global mean.
        loss = parts.total / global_count.to(parts.total.dtype).clamp_min(1) * self.dist.world_size
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if cfg.clip_norm > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # this update's rate; the scheduler then sets the next one
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.step += 1
        return StepOutcome(mean_loss, int(global_count), lr)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    # ---- evaluation, metrics, checkpoints (rank 0 only) ------------------------------------------

    def _evaluation_options(self) -> dict[str, Any]:
        return dict(
            kind=self.experiment.model_kind,
            batch_size=self.cfg.eval_batch_size,
            max_length=self.max_length,
            truncate=self.cfg.truncate,
            tokenizer=self.tokenizer,
            device=self.device,
            head_mask=self.head_mask,
            positions_seed=positions_seed(self.experiment),
        )

    def _evaluate(self, split: str, *, fit: bool = False) -> dict[str, Any] | None:
        """Evaluate on ``split``, log it, and remember it for the checkpoint of this step; with
        ``fit``, add whether the model fit its training split (``trained``, :mod:`attnlab.evaluation.fit`).
        At the end of training the record also says which weights were scored (:meth:`_final_fields`)."""
        if not self.dist.is_main:
            return None
        options = self._evaluation_options()
        result = evaluate(self.model, self.task, split, progress=self.progress, **options)
        if split == "valid" and result.get("examples") and (self.final is None or self.final.step == self.step):
            self.validation = validation_record(self.step, result)
        if fit:
            result.update(training_fit(self.model, self.task, **options))
        if self.final is not None:
            result.update(self._final_fields(split, result))
        self._write_metrics({"step": self.step, **result})
        if split == "valid":
            self.sink.attention(self.step, self.model, self.head_mask)
        return result

    def _evaluate_length_bins(self, length_generalisation: dict[str, Any] | None) -> None:
        """At the end: every length bin of ``task.eval_lengths`` (its own split), their accuracy
        per length plotted into ``accuracy_by_length.png``, and the horizon from the longest
        training length over them: a record of the pseudo-split ``length_bins``
        (:func:`attnlab.evaluation.horizon.chained_horizon`). The ``length_generalisation``
        evaluation (L+1..2L, when ``train.final_splits`` scored it) leads the chain where the first
        bin starts right after it, so bins of 21-40 after training on 1-10 are not credited with
        11-20."""
        bins = list(getattr(self.task, "length_bins", {}))
        results = [result for name in bins if (result := self._evaluate(name)) is not None]
        if results:
            plot_accuracy_by_length(results, self.run.plots)
            chain = results
            if length_generalisation and _ends_right_before(length_generalisation, results[0]):
                chain = [length_generalisation, *results]
            self._write_metrics(
                {
                    "step": self.step,
                    "split": "length_bins",
                    "horizon": chained_horizon(chain, trained_up_to=max(self.task.lengths("train"))),
                    "horizon_threshold": results[0]["horizon_threshold"],
                    "length_range": [chain[0]["length_range"][0], results[-1]["length_range"][1]],
                }
            )

    def _evaluate_depth_bins(self) -> None:
        """At the end: every depth bin of ``task.eval_depths`` (its own split)."""
        for name in getattr(self.task, "depth_bins", {}):
            self._evaluate(name)

    def _record_training_split(self) -> None:
        """A ``train`` record of the training split's statistics (:meth:`split_report` of a formal
        language: distinct strings, positives, the depth range of its members), for the tasks
        that report them."""
        report = getattr(self.task, "split_report", None)
        if report is not None:
            self._write_metrics({"step": self.step, "split": "train", **report("train", self.train_examples)})

    def _write_metrics(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        self.run.append_metrics(record)
        self.sink.write(record)
        if record.get("split") == "valid":  # the curves follow valid (the final checkpoint plots them too)
            plot_curves(self.run.read_metrics(), self.run.plots)

    def _checkpoint(self) -> None:
        if not self.dist.is_main:
            return
        write_checkpoint(
            self.run,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            self.stream,
            platform=self.platform,
            history=self.history,
            stopped=self.stopped,
            selected_weights=self.selected_weights,
            validation=self.validation,
            keep=self.cfg.keep_checkpoints,
            kernels=self.kernels,
        )
        plot_curves(self.run.read_metrics(), self.run.plots)
        self.log(f"checkpoint at step {self.step} in {self.run.path}")


def _ends_right_before(first: Mapping[str, Any], following: Mapping[str, Any]) -> bool:
    """Whether evaluation ``first``'s lengths end right before ``following``'s begin."""
    return "length_range" in first and int(first["length_range"][1]) + 1 == int(following["length_range"][0])
