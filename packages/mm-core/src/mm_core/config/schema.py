"""Typed schema of the top-level YAML: the blocks ``parallel``, ``data``, ``model``, ``training``, ``tools``.

Field names follow the MindSpeed-MM FSDP2 migration guide so its users recognise every line. Every block
forbids unknown keys; the loader turns validation failures into one-line errors naming the dotted key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

Auto = Literal["auto"]
DTypeName = Literal["bf16", "bfloat16", "fp16", "float16", "fp32", "float32"]


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return any(_accepts_bool(a) for a in get_args(annotation))


class Block(BaseModel):
    """Base of every config block: unknown keys are errors, values are validated on assignment, and float
    settings must be finite (YAML ``.inf``/``.nan`` are refused: an infinite lr silently trains to NaN)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML ``true``/``false`` is not a number (pydantic would read it as 1/0)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and not _accepts_bool(field.annotation):
            raise ValueError("expected a number or text, not a boolean")
        return value


# --------------------------------------------------------------------------------------------- parallel
class FSDPPlan(Block):
    apply_modules: list[str] = Field(default_factory=list)
    ignored_modules: list[str] = Field(default_factory=list)
    hook_modules: list[str] = Field(default_factory=list)
    param_dtype: DTypeName = "fp32"
    reduce_dtype: DTypeName = "fp32"
    output_dtype: DTypeName | None = None
    cast_forward_inputs: bool = True
    reshard_after_forward: bool = True
    num_to_forward_prefetch: int = Field(0, ge=0)
    num_to_backward_prefetch: int = Field(0, ge=0)
    pregather: bool = False
    cpu_offload: bool = False
    #: with gradient accumulation: true reduce-scatters each micro-batch's gradients (they stay sharded);
    #: false accumulates them unsharded and reduce-scatters once per step, after the last micro-batch (less
    #: communication, the memory of every unit's unsharded gradients; what Hugging Face's Trainer does)
    reduce_scatter_per_micro_batch: bool = True


class EPPlan(Block):
    apply_modules: list[str] = Field(default_factory=list)
    apply_efsdp_modules: list[str] = Field(default_factory=list)
    dispatcher: Literal["alltoall", "allgather", "mc2"] = "alltoall"


class ParallelConfig(Block):
    data_parallel_size: int | Auto = "auto"
    fully_shard_parallel_size: int | Auto = "auto"
    tensor_parallel_size: int = 1
    ulysses_parallel_size: int = Field(1, ge=1)
    ring_attention_size: int = Field(1, ge=1)
    expert_parallel_size: int = Field(1, ge=1)
    expert_fully_shard_parallel_size: int | Auto = "auto"
    timeout_minutes: int = Field(30, ge=1)  # collective timeout of every process group (torch's default: 30)
    fsdp_plan: FSDPPlan = Field(default_factory=FSDPPlan)
    ep_plan: EPPlan = Field(default_factory=EPPlan)

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tp_is_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("mm trains with FSDP2, not tensor parallelism; only 1 is accepted")
        return v

    @field_validator("data_parallel_size", "fully_shard_parallel_size", "expert_fully_shard_parallel_size")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("expected a positive integer or 'auto'")
        return v


# ------------------------------------------------------------------------------------------------- data
class DatasetParam(Block):
    dataset_type: str
    basic_parameters: dict[str, Any] = Field(default_factory=dict)
    preprocess_parameters: dict[str, Any] = Field(default_factory=dict)
    on_error: Literal["raise", "skip"] = "raise"


class CollateParam(Block):
    """Picks the collator; extra keys are passed through to it."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    collator_id: str | None = None
    model_name: str | None = None
    ignore_pad_token_for_loss: bool = True
    pad_to_multiple_of: int | None = Field(None, ge=1)

    @property
    def name(self) -> str | None:
        """The collator name: ``collator_id``, or its alias ``model_name``."""
        return self.collator_id or self.model_name


class DataloaderParam(Block):
    """``data.dataloader_param``. Both ``dataloader_mode`` values read the order of torch's DistributedSampler
    (``sampler_type: BaseRandomBatchSampler`` in micro-batches) through mm's resumable global-order sampler
    (see :mod:`mm_core.data.sampling` and packages/mm-core/tests/test_dataloader_modes.py)."""

    dataloader_mode: Literal["base", "sampler"] = "sampler"
    sampler_type: str = "BaseRandomBatchSampler"
    shuffle: bool = True
    drop_last: bool = True
    pin_memory: bool = False
    num_workers: int = Field(0, ge=0)
    prefetch_factor: int | None = Field(None, ge=1)
    persistent_workers: bool = False
    # Token-budget (dynamic) batching: each rank's micro-batch takes consecutive samples of the epoch's
    # global order while `count * longest <= max_tokens_per_batch` (training.micro_batch_size is then
    # ignored; the dataset must provide sample_lengths()). Samples are sorted by length, stably, within each
    # consecutive buffer of `dynamic_batch_buffer` samples of that order to cut padding; 1 keeps the order.
    max_tokens_per_batch: int | None = Field(None, ge=1)
    dynamic_batch_buffer: int = Field(256, ge=1)
    # Packing (SFT, vision-language, audio samples): each micro-batch's samples concatenated into ONE row of
    # at most `max_tokens_per_batch` tokens (the budget then counts the sum of lengths, not count * longest),
    # positions restarting per sample, no attention or label across samples (see mm_core.data.packing).
    packing: bool = False
    collate_param: CollateParam = Field(default_factory=CollateParam)

    @model_validator(mode="after")
    def _packing_needs_a_length(self) -> DataloaderParam:
        if self.packing and self.max_tokens_per_batch is None:
            raise ValueError(
                "packing: true needs data.dataloader_param.max_tokens_per_batch, the length each packed row "
                "is filled up to (e.g. the longest sample, cutoff_len, or more)"
            )
        return self


class DataConfig(Block):
    dataset_param: DatasetParam
    dataloader_param: DataloaderParam = Field(default_factory=DataloaderParam)
    #: the validation data (the ``dataset_param`` schema; several sources as ``basic_parameters.dataset``
    #: entries): its loss is computed every ``training.eval_interval`` steps and at the end (see
    #: mm_core.train.evaluation); read in index order, every sample once, its ``weights`` not applied
    eval_dataset_param: DatasetParam | None = None


# ------------------------------------------------------------------------------------------------ model
class LossConfig(Block):
    loss_type: Literal["raw", "default", "per_token_loss", "per_sample_loss"] = "default"
    router_aux_loss_coef: float = Field(0.0, ge=0)
    #: auxiliary-loss-free balancing of sigmoid-routed models (DeepSeek-V3 style, Megatron's
    #: ``moe_router_bias_update_rate``): after each applied optimizer step every MoE layer's
    #: ``e_score_correction_bias`` moves by this rate x sign(mean load - expert load), from the global
    #: tokens per expert of the step; 0: the bias is left as loaded (docs/parallelism.md)
    router_bias_update_rate: float = Field(0.0, ge=0)
    #: the output projection and the cross entropy computed chunk by chunk (``per_token_loss`` /
    #: ``per_sample_loss``), so the full-vocabulary logits of the sequence never exist at once; used when the
    #: model plan names its ``output_head`` (see docs/performance.md)
    chunked_loss: bool = True
    #: tokens per chunk of the chunked loss; ``auto``: as many as keep one chunk's fp32 logits and their
    #: gradient within 256 MiB, ``floor(256 MiB / (vocabulary x 4 bytes x 2))`` tokens (at least 1; 220 at
    #: Qwen's 151,936), resolved from the output head (``mm check`` prints it; docs/performance.md)
    loss_chunk_size: int | Auto = "auto"

    @field_validator("loss_chunk_size")
    @classmethod
    def _chunk_positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"give a positive number of tokens or auto, got {v}")
        return v


class RecomputePlan(Block):
    """``model.recompute_plan`` (used when ``model.recompute: true``; see docs/memory.md)."""

    apply_modules: list[str] = Field(default_factory=list)
    use_reentrant: bool = False
    recompute_granularity: Literal["full", "selective"] = "full"
    save_ops: list[str] = Field(default_factory=lambda: ["attention"])


class ActivationOffloadPlan(Block):
    """``model.activation_offload_plan`` (used when ``model.activation_offload: true``)."""

    apply_modules: list[str] = Field(default_factory=list)
    min_offload_bytes: int = Field(1024, ge=0)
    prefetch: bool = True


class ModelConfig(Block):
    model_id: str
    model_name_or_path: str | None = None
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    from_scratch: bool = False
    trust_remote_code: bool = False
    #: "auto": mm_varlen (document-aware, mm_core.models.varlen) for text-only causal LMs, else sdpa
    attn_implementation: str = "auto"
    freeze: list[str] = Field(default_factory=list)
    loss_cfg: LossConfig = Field(default_factory=LossConfig)
    recompute: bool = False
    recompute_plan: RecomputePlan = Field(default_factory=RecomputePlan)
    activation_offload: bool = False
    activation_offload_plan: ActivationOffloadPlan = Field(default_factory=ActivationOffloadPlan)
    #: tokens added to the tokenizer as special tokens; when they grow the vocabulary, the input embeddings
    #: and the output head (tied or not) are resized and the new rows take the mean of the existing ones
    #: (see mm_core.models.special_tokens)
    special_tokens: list[str] = Field(default_factory=list)


# --------------------------------------------------------------------------------------------- training
class LoraConfig(Block):
    enable: bool = False
    rank: int = Field(8, ge=1)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=list)
    #: checkpoints hold only the adapter weights (the base weights come from model.model_name_or_path)
    save_adapters_only: bool = False


class MuonConfig(Block):
    """``training.muon``: used when ``training.optimizer: muon`` (see docs/muon.md)."""

    momentum: float = Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    ns_steps: int = Field(5, ge=1)
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    eps: float = Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    ns_dtype: DTypeName = "bf16"
    adamw_lr: float | None = Field(None, ge=0)
    exclude: list[str] = Field(default_factory=list)
    clip_muon_params: bool = True


class TrainingConfig(Block):
    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation_steps: int | None = Field(1, ge=1)
    #: the run's length in optimizer steps; or give ``train_epochs`` instead (exactly one of the two)
    train_iters: int | None = Field(None, ge=1)
    #: the run's length in passes over the training data: ``train_iters`` becomes
    #: ``ceil(train_epochs x micro-batches per epoch / gradient_accumulation_steps)``, counted from the
    #: dataset, the micro-batch size (or token budget) and the data-parallel size once the run starts (see
    #: :func:`mm_core.data.epochs.iters_for_epochs`); fractions of an epoch are allowed
    train_epochs: float | None = Field(None, gt=0)
    seed: int = 42
    lr: float = Field(1e-5, ge=0)
    lr_min: float = Field(0.0, ge=0)
    lr_warmup_ratio: float = Field(0.0, ge=0, le=1)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    clip_grad: float | None = Field(1.0, ge=0)
    optimizer: str = "adamw"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    adam_fused: bool = True
    #: build on the meta device, shard, then initialise or load per rank; ``auto``: whenever the model can be
    #: (see mm_core.parallel.apply.meta_init)
    init_model_with_meta_device: bool | Auto = "auto"
    load: str | None = None
    load_strict: bool = True
    no_load_optim: bool = False
    no_load_rng: bool = False
    save: str | None = None
    save_interval: int = Field(1000, ge=1)
    save_async: bool = False
    save_total_limit: int | None = Field(None, ge=1)
    #: every this many steps (and at the last step) also write a Hugging Face folder of the main model,
    #: ``<save>/hf/step_<N>/`` (config, safetensors, tokenizer/processor files), loadable by plain
    #: transformers; None: none (``mm convert dcp-to-hf`` exports any DCP checkpoint later)
    save_hf_interval: int | None = Field(None, ge=1)
    no_save_optim: bool = False
    no_save_rng: bool = False
    log_interval: int = Field(1, ge=1)
    #: with ``data.eval_dataset_param``: evaluate every this many steps (and at the last step)
    eval_interval: int = Field(1000, ge=1)
    #: global batches (micro_batch_size x gradient_accumulation_steps x data-parallel ranks samples, or
    #: token-budget micro-batches) each evaluation reads from the start of the eval set; null: all of it
    eval_iters: int | None = Field(None, ge=1)
    use_deter_comp: bool = False
    plugin: list[str] = Field(default_factory=list)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    muon: MuonConfig = Field(default_factory=MuonConfig)
    #: parameter or module path pattern -> learning-rate multiplier of the parameters it matches (every
    #: optimizer group, Muon's and AdamW's alike; the schedule scales each group from its own base lr). The
    #: first pattern in YAML order that matches a parameter wins; a pattern matching no trainable parameter,
    #: or only parameters an earlier pattern took, is an error (see mm_core.optim.lr_scaling)
    lr_scaling_plan: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    output_dir: str | None = None
    #: an existing output_dir holding another run's metrics.jsonl is refused unless this is true
    overwrite_output_dir: bool = False
    #: steps with a non-finite loss or grad norm that may be skipped (no optimizer update) before the run
    #: stops with an error; 0: the first one stops the run
    skip_nonfinite_steps: int = Field(0, ge=0)
    progress_bar: bool = True
    #: torch.compile each FSDP unit (the plan's ``fsdp_units``) in place before sharding, as torchtitan does
    compile: bool = False
    #: the training task (``mm.tasks`` entry point): its models, optimizers and step. ``standard``: one
    #: model, one optimizer, the loss of ``model.loss_cfg`` (language models, VLMs, diffusion transformers)
    task: str = "standard"
    #: the task's own settings, read and checked by the task (``standard`` takes none)
    task_param: dict[str, Any] = Field(default_factory=dict)

    #: ``train_iters`` computed from ``train_epochs`` once the dataset is known (see :attr:`total_iters`)
    _epoch_iters: int | None = PrivateAttr(None)

    @property
    def grad_accum(self) -> int:
        """Gradient accumulation steps (an empty value turns accumulation off)."""
        return self.gradient_accumulation_steps or 1

    @model_validator(mode="after")
    def _one_budget(self) -> TrainingConfig:
        if (self.train_iters is None) == (self.train_epochs is None):
            got = (
                f"both (train_iters {self.train_iters}, train_epochs {self.train_epochs})"
                if self.train_iters is not None
                else "neither"
            )
            raise ValueError(
                f"give exactly one of training.train_iters (optimizer steps) and training.train_epochs "
                f"(passes over the data), got {got}; set the other to null"
            )
        return self

    @property
    def total_iters(self) -> int:
        """The run's optimizer steps: ``train_iters``, or the steps of ``train_epochs`` once
        :meth:`set_epoch_iters` resolved them from the dataset."""
        if self.train_iters is not None:
            return self.train_iters
        if self._epoch_iters is None:
            raise RuntimeError(
                "training.train_epochs is not resolved into steps yet (the trainer does so from the dataset)"
            )
        return self._epoch_iters

    def set_epoch_iters(self, iters: int) -> None:
        """The steps that ``train_epochs`` comes to (:func:`mm_core.data.epochs.iters_for_epochs`)."""
        self._epoch_iters = iters


# ------------------------------------------------------------------------------------------------ tools
class _StepWindow(Block):
    @field_validator("end_step", check_fields=False)
    @classmethod
    def _end_after_start(cls, v: int, info: ValidationInfo) -> int:
        start = info.data.get("start_step")
        if start is not None and v < start:
            raise ValueError(f"must be >= start_step ({start})")
        return v


class StaticProfileParam(Block):
    """``tools.profile.static_param``: MindSpeed-MM's spelling of the profiled window and its options. Its
    window is ``[start_step, end_step)`` (``start_step: 0``: from the first step); mm folds every key given
    into :class:`ProfileConfig` (an inclusive window from step 1), so both spellings mean the same run."""

    level: Literal["level_none", "level0", "level1", "level2"] | None = None
    with_stack: bool | None = None
    with_memory: bool | None = None
    record_shapes: bool | None = None
    with_cpu: bool | None = None
    save_path: str | None = None
    start_step: int | None = Field(None, ge=0)
    end_step: int | None = Field(None, ge=1)
    data_simplification: bool | None = None
    aic_metrics_type: str | None = None
    analyse_flag: bool | None = None

    @field_validator("analyse_flag")
    @classmethod
    def _analysed(cls, v: bool | None) -> bool | None:
        if v is False:
            raise ValueError(
                "mm always writes the analysed result (a Chrome trace and an operator table) when the window "
                "ends; offline-only collection is not offered, so only true (or leaving it out) is accepted"
            )
        return v


#: what :class:`StaticProfileParam` keys become in :class:`ProfileConfig` (the window is converted apart)
_STATIC_SAME = ("level", "with_stack", "with_memory", "record_shapes", "with_cpu", "save_path",
                "data_simplification", "aic_metrics_type")  # fmt: skip


class ProfileConfig(_StepWindow):
    enable: bool = False
    #: MindSpeed-MM's profiler kind: ``static`` (a fixed step window, what mm records); ``dynamic`` (started
    #: and stopped from outside through torch_npu's dynamic_profile control file) is refused
    profile_type: Literal["static"] = "static"
    ranks: list[int] = Field(default_factory=lambda: [0])
    start_step: int = Field(1, ge=1)
    end_step: int = Field(2, ge=1)
    save_path: str | None = None
    record_shapes: bool = False
    with_stack: bool = False
    with_memory: bool = False
    #: record host (CPU) activity; null: always on a CPU run, and beside the device activity elsewhere
    with_cpu: bool | None = None
    #: Ascend NPU only (torch_npu's experimental config): the collection level, the AI Core metrics
    #: (``AiCMetrics`` member name, e.g. PipeUtilization) and data simplification; noted and unused elsewhere
    level: Literal["level_none", "level0", "level1", "level2"] | None = None
    aic_metrics_type: str | None = None
    data_simplification: bool | None = None
    static_param: StaticProfileParam | None = None

    @field_validator("profile_type", mode="before")
    @classmethod
    def _static_only(cls, v: Any) -> Any:
        if v == "dynamic":
            raise ValueError(
                "dynamic profiling (torch_npu's dynamic_profile, steered by a control file while the job "
                "runs) is not supported; use static with start_step/end_step (or static_param)"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _fold_static_param(cls, data: Any) -> Any:
        """``static_param.*`` given: its keys set the flat ones; a key given both ways must agree."""
        if not isinstance(data, dict) or not isinstance(data.get("static_param"), dict):
            return data
        static = StaticProfileParam.model_validate(data["static_param"])
        given = static.model_dump(exclude_none=True)
        out = dict(data)
        folded = {k: given[k] for k in _STATIC_SAME if k in given}
        if "start_step" in given:
            folded["start_step"] = max(given["start_step"], 1)  # [0, ...) and [1, ...) both start at step 1
        if "end_step" in given:
            first = folded.get("start_step", data.get("start_step", 1))
            # [start, end) counts steps from 1; [0, end) is the first `end` steps (MindSpeed-MM's profiler:
            # skip start - 1 steps, record end - start)
            last = given["end_step"] - (0 if given.get("start_step") == 0 else 1)
            if last < first:
                raise ValueError(
                    f"static_param.end_step: {given['end_step']} profiles no step; the window is "
                    f"[start_step, end_step), so it must be > {first}"
                )
            folded["end_step"] = last
        for key, value in folded.items():
            if key in data and data[key] != value:
                raise ValueError(
                    f"{key}: {data[key]!r} disagrees with static_param.{key} (read as {value!r}); "
                    "give it once"
                )
            out[key] = value
        return out


class MemoryProfileConfig(_StepWindow):
    enable: bool = False
    ranks: list[int] = Field(default_factory=lambda: [0])
    #: MindSpeed-MM's name of ``ranks`` (give one of them)
    dump_ranks: list[int] | None = None
    start_step: int = Field(1, ge=1)
    end_step: int = Field(2, ge=1)
    save_path: str | None = None
    #: allocator history frames (accelerators): ``python`` frames only, or ``all`` (with C++ frames)
    stacks: Literal["python", "all"] = "all"
    #: allocation/free events kept in the history (accelerators); null: 100,000
    max_entries: int | None = Field(None, ge=1)
    #: also log the memory of every profiled step (allocated/reserved/peak, or the RSS on a CPU)
    mem_info: bool = False

    @model_validator(mode="before")
    @classmethod
    def _dump_ranks(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("dump_ranks") is not None:
            if "ranks" in data and list(data["ranks"]) != list(data["dump_ranks"]):
                raise ValueError(
                    f"ranks {data['ranks']} and dump_ranks {data['dump_ranks']} disagree; give one"
                )
            data = {**data, "ranks": data["dump_ranks"]}
        return data


class TensorboardConfig(Block):
    enable: bool = False
    log_dir: str | None = None
    #: MindSpeed-MM's name of ``log_dir`` (give one of them)
    dir: str | None = None
    #: accepted for MindSpeed-MM configs; as there, unused: scalars are written at each logged step
    #: (``training.log_interval``)
    interval: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_dir(self) -> TensorboardConfig:
        if self.dir is not None and self.log_dir is not None and self.dir != self.log_dir:
            raise ValueError(f"log_dir {self.log_dir!r} and dir {self.dir!r} disagree; give one")
        return self

    @property
    def folder(self) -> str | None:
        """Where the events go (``log_dir`` or ``dir``; None: ``<output_dir>/tb``)."""
        return self.log_dir or self.dir


class WandbConfig(Block):
    """``tools.wandb``: scalars and the run's config to Weights & Biases (``pip install mm-core[wandb]``),
    from rank 0."""

    enable: bool = False
    project: str | None = None
    #: the run's name (null: the output folder's name)
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    #: where wandb keeps its files (null: ``<output_dir>``)
    dir: str | None = None


class SwanlabConfig(Block):
    """``tools.swanlab``: scalars and the run's config to SwanLab (``pip install mm-core[swanlab]``), from
    rank 0."""

    enable: bool = False
    project: str | None = None
    #: the experiment's name (null: the output folder's name)
    name: str | None = None
    #: ``offline``: files only, for ``swanlab sync``; ``local`` needs SwanLab's dashboard (swanlab[dashboard])
    mode: Literal["cloud", "local", "offline", "disabled"] = "cloud"
    #: where SwanLab keeps its files (null: ``<output_dir>/swanlog``)
    logdir: str | None = None


class ToolsConfig(Block):
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    memory_profile: MemoryProfileConfig = Field(default_factory=MemoryProfileConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    #: peak TFLOP/s of one device for ``mfu`` in metrics.jsonl (null: mm's table of known accelerators in bf16
    #: or fp16; no ``mfu`` on other devices, e.g. a CPU)
    peak_tflops: float | None = Field(None, gt=0)


# ------------------------------------------------------------------------------------------------- root
class MMConfig(Block):
    """The whole run, as written in one YAML file (plus command-line overrides)."""

    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig
    model: ModelConfig
    training: TrainingConfig
    tools: ToolsConfig = Field(default_factory=ToolsConfig)

    @model_validator(mode="after")
    def _packing_fits(self) -> MMConfig:
        """A packed row holds several samples: no per-sample loss, no context split of the row."""
        if not self.data.dataloader_param.packing:
            return self
        if self.model.loss_cfg.loss_type == "per_sample_loss":
            raise ValueError(
                "data.dataloader_param.packing: true packs several samples into one row, which "
                "model.loss_cfg.loss_type: per_sample_loss would weigh as one sample; use per_token_loss "
                "(the default) or packing: false"
            )
        cp = self.parallel.ulysses_parallel_size * self.parallel.ring_attention_size
        if cp > 1:
            raise ValueError(
                "data.dataloader_param.packing: true is not supported with context parallelism "
                f"(parallel.ulysses_parallel_size x ring_attention_size = {cp}): the split of a packed row "
                "does not carry its sample boundaries; set packing: false or both sizes to 1"
            )
        return self
