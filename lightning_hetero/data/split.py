"""The loader split of one strategy: every loader rebuilt so each rank draws its share of the same global batches.

:class:`LoaderSplit` is owned by :class:`~lightning_hetero.strategies.core.HeteroCore`. It builds a
:class:`~lightning_hetero.data.sampler.HeteroBatchSampler` (or a stream splitter) that reads the share plan's
schedule, attaches per-sample costs, and sets up micro-batching; the plan's share state restores or profiles shares
before the training loader's first batch.

Example::

    split = LoaderSplit(view, plan, lab, share_state, resilience, options)
    loader = split.process_dataloader(loader)
"""

from typing import Any, Optional, Union

from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

import lightning_hetero._compat as _compat
from lightning_hetero.config import Options, parse_micro_batch
from lightning_hetero.data.loaders import global_order, global_seed, rebuild_loader
from lightning_hetero.data.microbatch import check_micro_limits, micro_limits
from lightning_hetero.data.sampler import GlobalOrder, HeteroBatchSampler, check_training_batch, for_evaluation
from lightning_hetero.data.streaming import build_stream_loader, stream_global_batch
from lightning_hetero.data.tokens import dataset_costs, resolve_cost_fn
from lightning_hetero.lab.setup import LabSetup
from lightning_hetero.observe.notices import silence_inexact_resume_warning
from lightning_hetero.plan.shares import SharePlan
from lightning_hetero.plan.state import ShareState
from lightning_hetero.resilience.hooks import ResilienceHooks
from lightning_hetero.view import StrategyView


class LoaderSplit:
    """Every loader of the job split by the plan; the training sampler, and this rank's micro-batch limit."""

    def __init__(self, view: StrategyView, plan: SharePlan, lab: LabSetup, share_state: ShareState,
                 resilience: ResilienceHooks, options: Options) -> None:
        self.view = view
        self.plan = plan
        self.lab = lab
        self.share_state = share_state
        self.resilience = resilience
        self.options = options
        self.micro_batch = parse_micro_batch(options.data.micro_batch)
        self.train_sampler: Optional[HeteroBatchSampler] = None
        # Evaluation samplers by (stage, dataset): a reloaded loader replaces its predecessor. Plain containers only:
        # the spawn launcher pickles the strategy.
        self.eval_samplers: dict[tuple[str, int], HeteroBatchSampler] = {}
        # This rank's samples per forward/backward (None: the whole share).
        self.micro_limit: Optional[int] = None

    def sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's ``DistributedSampler`` arguments (the batch sampler replaces that sampler anyway): the
        cluster's world size, not num_nodes × devices (unequal hosts). Evaluating: one replica, since Lightning's
        prediction sampler asserts a sample on every rank (the batch sampler gives a sampleless rank a padding step),
        and a standalone validate / test would warn that a DistributedSampler replicates samples (the batch sampler
        evaluates each sample once)."""
        view = self.view
        trainer = _compat.trainer_of(view.lightning_module) if view.lightning_module is not None else None
        if trainer is not None and trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": view.world_size, "rank": view.global_rank}

    def process_dataloader(self, dataloader: object) -> object:
        view = self.view
        trainer = _compat.trainer_of(view.lightning_module)
        stage = trainer.state.stage if trainer is not None else None
        loader_name = f"{stage.dataloader_prefix}_dataloader" if stage is not None else "dataloader"
        profile_view: Any = dataloader
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset):
            progress = trainer.fit_loop.epoch_progress.current if trainer is not None else None
            global_batch = stream_global_batch(dataloader, self.plan.global_batch_size, view.world_size, loader_name)
            batch_sampler, new_loader, profile_view = build_stream_loader(
                dataloader, _stream_loader_settings(dataloader), self.options.data.stream_mode,
                self.plan.new_schedule(global_batch), view.global_rank, view.root_device, global_seed(),
                epoch_fn=(lambda: progress.processed) if progress is not None else None,
                training=stage == RunningStage.TRAINING,
            )
        else:
            batch_sampler = self._build_batch_sampler(dataloader, loader_name)
            # Every evaluation sample once, in equal batch counts.
            if stage != RunningStage.TRAINING:
                batch_sampler = for_evaluation(batch_sampler)
            outer = dataloader.batch_sampler  # type: ignore[attr-defined]
            # The prediction loop tracks batch indices through Lightning's wrapper: keep it around ours.
            wrapped = _compat.IndexBatchSamplerWrapper(batch_sampler) if isinstance(
                outer, _compat.IndexBatchSamplerWrapper) else batch_sampler
            new_loader = rebuild_loader(dataloader, wrapped)  # type: ignore[arg-type]
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if stage == RunningStage.TRAINING:
            self.plan.use_train_schedule(batch_sampler.schedule)
            self._on_train_loader(batch_sampler, dataloader, profile_view)
        else:
            key = (str(stage), id(dataloader.dataset))  # type: ignore[attr-defined]
            previous = self.eval_samplers.get(key)
            self.plan.follow(batch_sampler.schedule, replaces=previous.schedule if previous is not None else None)
            self.eval_samplers[key] = batch_sampler
            # A validate/test/predict-only run's table shows its own loader's split.
            if not fitting and self.plan.schedule is None:
                self.plan.use_train_schedule(batch_sampler.schedule)
        if stage == RunningStage.TRAINING or not fitting:
            self.show_table()
        return new_loader

    def show_table(self) -> None:
        owner = type(self.view).__name__
        if self.options.observation.print_table and not self.lab.table_printed and self.view.global_rank == 0:
            rank_zero_info(f"{owner} lab:\n" + self.lab.lab.table(self.plan))
        self.lab.table_printed = True

    def _on_train_loader(self, batch_sampler: HeteroBatchSampler, dataloader: Any, profile_view: Any) -> None:
        map_style = not isinstance(dataloader.dataset, IterableDataset)
        # A global batch the dataset cannot fill is never trained on.
        if map_style:
            check_training_batch(batch_sampler, "train_dataloader", explicit=self.plan.global_batch_size is not None)
        self.train_sampler = batch_sampler
        self._attach_costs(batch_sampler, dataloader.dataset)
        batch_sampler.cap_shares = self.micro_batch is None
        # Before the loader's first batch is drawn: restored or profiled shares apply from batch 0.
        self.resilience.rank_states.register("shares", self.share_state)
        self.share_state.on_train_loader(batch_sampler, profile_view)
        self._setup_micro_batching()
        # Resumed at the exact batch: Lightning's warning is wrong here.
        if self.share_state.position > 0 and map_style:
            silence_inexact_resume_warning()
        # Resumed at an epoch start: the epoch's iterator draws from the saved state.
        if self.share_state.position == 0:
            self.resilience.rng.apply()

    def _build_batch_sampler(self, dataloader: object, loader_name: str) -> HeteroBatchSampler:
        if not isinstance(dataloader, DataLoader):
            raise ValueError(
                f"{loader_name}: {type(dataloader).__name__} is not a torch DataLoader; the strategy splits the "
                "global batch through the DataLoader's sampler. Return a DataLoader over a map-style dataset."
            )
        outer = dataloader.batch_sampler
        inner = _compat.unwrap_index_batch_sampler(outer)
        if isinstance(inner, HeteroBatchSampler):
            return inner
        if inner is None:
            raise ValueError(
                f"{loader_name}: a DataLoader with `batch_size=None` yields single samples; the strategy splits "
                "global batches. Pass `batch_size=` or a batch sampler."
            )
        explicit = self.plan.global_batch_size
        if type(inner) is BatchSampler:
            order = global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore[arg-type]
            global_batch = explicit or inner.batch_size * self.view.world_size
            drop_last = inner.drop_last
        else:
            # A custom batch sampler (e.g. bucketing by length): every batch it yields is one global batch.
            if explicit is not None:
                raise ValueError(
                    f"`global_batch_size`={explicit} is set, but {loader_name} has a custom batch "
                    f"sampler ({type(inner).__name__}) whose batches are the global batches. Leave "
                    "`global_batch_size` at None."
                )
            if isinstance(getattr(inner, "sampler", None), Sampler) and not isinstance(inner.sampler, GlobalOrder):
                # Lightning injected a DistributedSampler (a shard): every rank draws the whole order instead.
                inner.sampler = global_order(inner.sampler, len(dataloader.dataset), loader_name)  # type: ignore
            order = GlobalOrder(len(dataloader.dataset), shuffle=False, seed=global_seed(), source=inner,
                                batches=True)  # type: ignore[arg-type]
            # The largest batch is the nominal global batch (table, rebalancing); smaller ones are split alike.
            global_batch = max((len(b) for b in order.global_batches(0, False)), default=0)
            drop_last = False
        # The plan's schedule refuses a global batch smaller than the number of replicas, naming the argument.
        schedule = self.plan.new_schedule(global_batch, epoch=order.epoch)
        return HeteroBatchSampler(
            order, global_batch_size=global_batch, capacities=schedule.capacities, rank=self.view.global_rank,
            drop_last=drop_last, schedule=schedule,
        )

    def _attach_costs(self, sampler: HeteroBatchSampler, dataset: Any) -> None:
        """Per-sample costs for token balance or token weighting (read once per training loader, shared)."""
        data = self.options.data
        if not data.uses_costs:
            return
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                f"`data.balance`={data.balance!r} / `data.loss_denominator`={data.loss_denominator!r}: per-sample "
                "costs are read by index, which a stream (IterableDataset) has not; use 'samples' with streams."
            )
        if sampler.costs is None:
            view = self.view
            cost_fn = resolve_cost_fn(data.sample_cost, view.lightning_module, dataset)
            costs = dataset_costs(dataset, cost_fn, view.global_rank, view.world_size, view.root_device)
            sampler.use_costs(costs, balance=data.balance != "samples", weight=data.loss_denominator == "tokens",
                              padded=data.balance == "padded_tokens")

    def _setup_micro_batching(self) -> None:
        limits = micro_limits(self.micro_batch, self.plan.caps, self.view.world_size)
        if limits is None:
            return
        module = self.view.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ValueError("`data.micro_batch` needs automatic optimization: a manual-optimization `training_step` "
                             "steps its own optimizer and cannot be split into micro-batches.")
        check_micro_limits(limits, self.plan.min_share)
        self.micro_limit = limits[self.view.global_rank]
        self.lab.add_columns({"micro-batch": ["-" if m is None else str(m) for m in limits]})


def _stream_loader_settings(dataloader: DataLoader) -> dict[str, Any]:
    """A stream loader's worker, memory and collation settings (what its rebuilt loader keeps)."""
    names = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
             "generator", "persistent_workers", "pin_memory_device", "in_order")
    kwargs: dict[str, Union[int, Any]] = {
        name: getattr(dataloader, name) for name in names if hasattr(dataloader, name)}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return kwargs
