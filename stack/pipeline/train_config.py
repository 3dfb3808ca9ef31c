"""`train`: strategy, precision, launcher, checkpoints, tracking."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from stack import safe_values
from stack.pipeline.checks import Problems, bounded, choice, positive


STRATEGIES = ("auto", "ddp", "fsdp")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ACCELERATORS = ("auto", "cpu", "gpu")
LAUNCHERS = ("local", "slurm", "torchrun")
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""URI schemes train.tracking_uri accepts (MLflow's tracking stores; `+driver` suffixes allowed)."""
TRACKING_OFF = ("off", "false", "no", "none")
"""Spellings of train.tracking_uri that turn tracking off; the schema keeps `off`."""
TRACKING_FILES = (".db", ".sqlite", ".sqlite3")
"""Endings of a path train.tracking_uri names as a SQLite store (a bare word is a typo, not a store in the cwd)."""


MAX_STEPS = 1_000_000_000
"""Most optimizer steps any step count may name (a billion: years of training at several steps a second)."""
TRAIN_BOUNDS = (
    ("max_epochs", 1_000_000, "epochs (bound a long run with max_steps); e.g. 20"),
    ("max_steps", MAX_STEPS, "steps (years of training); e.g. 2000, or -1 for no bound"),
    ("warmup_steps", MAX_STEPS, "steps; e.g. 50"),
    ("checkpoint_every_n_steps", MAX_STEPS, "steps; e.g. 200"),
    ("log_every_n_steps", MAX_STEPS, "steps; e.g. 10"),
    ("devices", 1024, "processes per node (a node holds up to 8-16 GPUs); e.g. 8"),
    ("num_nodes", 100_000, "nodes (more than any cluster); e.g. 4"),
    ("keep_checkpoints", 10_000, "checkpoints (each is the whole training state on disk); e.g. 2"),
    ("profile_steps", 1_000, "steps (the Chrome trace of a few steps is already large); e.g. 6"),
    ("slurm_signal_seconds", 65_535, "s (sbatch --signal takes at most 65535 seconds); e.g. 300"),
    ("slurm_cpus_per_task", 4_096, "CPUs per rank (more than any node holds); e.g. 8"),
)
"""Upper bounds of TrainConfig's counts: (field, bound, why)."""


@dataclass
class TrainConfig:
    """How `stack train` fits the model (Lightning)."""

    out_dir: str = "runs/train"
    """Folder for checkpoints, logs and the resolved pipeline."""
    seed: int = 0
    """Seed for weights, data order and augmentation."""
    max_epochs: int = 20
    """Upper bound on epochs."""
    max_steps: int = -1
    """Upper bound on optimizer steps; -1 means no bound (epochs decide)."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 50
    """Linear warm-up steps before cosine decay."""
    grad_clip: float = 5.0
    """Gradient-norm clip; 0 disables."""
    accelerator: str = "auto"
    """`auto`, `cpu` or `gpu`."""
    devices: int = 1
    """Processes (GPUs, or CPU ranks) per node."""
    num_nodes: int = 1
    """Nodes in the job."""
    strategy: str = "auto"
    """`auto`, `ddp`, or `fsdp` (FSDP2 `fully_shard`)."""
    precision: str = "bf16-mixed"
    """`32-true`, `bf16-mixed` or `16-mixed`."""
    activation_checkpointing: List[str] = field(default_factory=list)
    """Module groups to recompute in backward (e.g. `backbone`, `bev_encoder`)."""
    compile: bool = False
    """Wrap the model in `torch.compile` (slow to compile on small CPUs)."""
    checkpoint_every_n_steps: int = 200
    """Write a resumable checkpoint every N optimizer steps."""
    resume: Optional[str] = None
    """Checkpoint to resume from (a `.ckpt` file, a sharded checkpoint folder, or a run's out_dir
    to take its latest checkpoint); null starts fresh."""
    overwrite: bool = False
    """Start fresh in an out_dir that already holds a run (model.pt or checkpoints), deleting that
    run's checkpoints, weights and logs. Without it such an out_dir is refused unless train.resume is set."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    fsdp_units: List[str] = field(default_factory=lambda: ["*"])
    """FSDP2 sharding policy: module-name patterns, one `.`-separated glob per level, each match
    sharded as its own unit (`*` = every top-level part, `backbone.*` = each backbone stage,
    `backbone.*.*` = each block); the whole model is the outer unit."""
    fsdp_replicate: str = "auto"
    """FSDP2 hybrid sharding (HSDP): how many replicas of the sharded model; each shards it over
    (num_nodes x devices) / fsdp_replicate ranks. `auto` = one replica per node (shard within a
    node, replicate across nodes); `1` = shard over every rank (plain FSDP)."""
    fsdp_cpu_offload: bool = False
    """FSDP2 on GPUs: keep parameter shards, gradients and optimizer state in host memory
    (`CPUOffloadPolicy`; the optimizer step runs on the CPU). Refused on CPU ranks."""
    launcher: str = "local"
    """`local` (this machine; Lightning starts the ranks), `slurm` (write an sbatch script that
    runs the same command under srun, and submit it) or `torchrun` (multi-node rendezvous)."""
    rendezvous: str = "localhost:29500"
    """host:port of the torchrun rendezvous (launcher=torchrun): run the same command on every node."""
    slurm_partition: str = ""
    """SLURM partition for launcher=slurm; empty uses the cluster's default."""
    slurm_time: str = "04:00:00"
    """SLURM wall-time limit for launcher=slurm: HH:MM:SS, D-HH:MM:SS, MM (sbatch --time forms)."""
    slurm_extra: List[str] = field(default_factory=list)
    """Extra `#SBATCH` options for launcher=slurm, e.g. `--account=perception`."""
    slurm_requeue: bool = True
    """launcher=slurm: `--requeue` and `--signal=USR1@slurm_signal_seconds`; on that signal (or SIGTERM from
    preemption) training checkpoints at the step's end and requeues, and the requeued job resumes by itself."""
    slurm_signal_seconds: int = 300
    """Seconds before the time limit that SLURM signals the job (room for one checkpoint; SLURM may signal up to 60 s early)."""
    slurm_cpus_per_task: int = 0
    """`--cpus-per-task` for each rank (data-loading workers need them); 0 leaves it to the cluster."""
    slurm_mem: str = ""
    """`--mem` per node: a count with an optional K/M/G/T suffix (megabytes without), e.g. 256G; empty leaves it to the cluster."""
    slurm_container_image: str = ""
    """Container image the ranks run in (pyxis/enroot `srun --container-image`: `nvcr.io#nvidia/pytorch:24.05-py3`
    or a `.sqsh` path); it must have `stack` installed (`python -m stack`). Empty runs on the host."""
    slurm_container_mounts: List[str] = field(default_factory=list)
    """`SRC[:DST[:FLAGS]]` mounts into the container (pyxis `--container-mounts`), e.g. `/data:/data:ro`; mount the
    working folder, data.root and train.out_dir at the same paths."""
    log_every_n_steps: int = 10
    """Steps between metric log rows (TensorBoard, CSV, progress bar)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s used for MFU; 0 measures it once per run with a matmul at the training precision."""
    count_comm_bytes: bool = False
    """On more than one rank, log `perf/comm_sent_mb` (bytes this rank sends in collectives, `stack.train.comm`).
    Off by default: counting wraps torch.distributed's collectives and replaces DDP's C++ all-reduce with the
    Python default comm hook; `stack bench train-memory` turns it on."""
    profile_steps: int = 6
    """Steps `stack profile` records (after 2 warm-up steps)."""
    tracking_uri: str = ""
    """MLflow tracking store for `stack train` (and `stack eval`/`deploy`/`runs`): empty = the SQLite file
    `mlruns.db` beside train.out_dir (nothing to start); a path = that SQLite file; `http(s)://host:port` = a
    tracking server; `sqlite:///`, `postgresql://`, `mysql://` URIs as MLflow takes them; `off` = no tracking."""

    def __post_init__(self):
        # YAML 1.1 reads an unquoted `off`/`no`/`false` as a boolean, which this string field receives as 'False'
        if str(self.tracking_uri).strip().lower() in TRACKING_OFF:
            self.tracking_uri = "off"

    def problems(self) -> Problems:
        found: Problems = []
        positive(found, "max_epochs", self.max_epochs)
        if self.max_steps == 0 or self.max_steps < -1:
            found.append(("max_steps", f"got {self.max_steps}; use -1 (no bound) or a positive count"))
        positive(found, "lr", self.lr)
        for name in ("weight_decay", "warmup_steps", "grad_clip"):
            value = getattr(self, name)
            if value < 0:
                found.append((name, f"got {value}; must be >= 0"))
        choice(found, "accelerator", self.accelerator, ACCELERATORS)
        choice(found, "strategy", self.strategy, STRATEGIES)
        choice(found, "precision", self.precision, PRECISIONS)
        positive(found, "devices", self.devices)
        positive(found, "num_nodes", self.num_nodes)
        positive(found, "checkpoint_every_n_steps", self.checkpoint_every_n_steps)
        choice(found, "launcher", self.launcher, LAUNCHERS)
        for name in ("keep_checkpoints", "log_every_n_steps", "profile_steps"):
            positive(found, name, getattr(self, name))
        bounded(found, self, TRAIN_BOUNDS)
        if self.peak_tflops < 0:
            found.append(("peak_tflops", f"got {self.peak_tflops}; use 0 (measure) or a positive peak"))
        scheme = self.tracking_uri.split("://", 1)[0] if "://" in self.tracking_uri else ""
        path_named = not scheme and self.tracking_uri not in ("", "off", "databricks")
        if scheme and scheme.split("+")[0] not in TRACKING_SCHEMES or self.tracking_uri.startswith("file:"):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}; use empty (SQLite beside out_dir), a .db path, "
                                          f"off, or a URI of {', '.join(TRACKING_SCHEMES)} (MLflow's file store is "
                                          "retired: use a .db path)"))
        elif scheme.startswith("sqlite") and not self.tracking_uri.split("://", 1)[1].startswith("/"):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}: a sqlite URI needs three slashes and a path "
                                          "(sqlite:///runs/mlruns.db; with two, SQLAlchemy keeps the store in memory "
                                          "and every run is lost), or give the path alone"))
        elif path_named and not self.tracking_uri.lower().endswith(TRACKING_FILES):
            found.append(("tracking_uri", f"got {self.tracking_uri!r}, which is neither a URI nor a SQLite file "
                                          f"({', '.join(TRACKING_FILES)}); use empty (mlruns.db beside out_dir), "
                                          "a path like runs/mlruns.db, a server URI, or off"))
        if not self.fsdp_units:
            found.append(("fsdp_units", "got an empty list; use [\"*\"] to shard each top-level part"))
        world = self.devices * self.num_nodes
        replicate = self.num_nodes if self.fsdp_replicate == "auto" else (
            int(self.fsdp_replicate) if str(self.fsdp_replicate).isdigit() else 0)
        if replicate < 1 or world % replicate:
            found.append(("fsdp_replicate", f"got {self.fsdp_replicate!r}; use auto (one replica per node) or a "
                                            f"divisor of the {world} ranks (num_nodes x devices)"))
        host, _, port = self.rendezvous.rpartition(":")
        if not host or not port.isdigit() or any(c.isspace() for c in host):
            found.append(("rendezvous", f"got {self.rendezvous!r}; expected host:port, e.g. node001:29500"))
        # these are written into the sbatch script (stack.train.launch): formats, not just strings
        for name, check in (("slurm_time", safe_values.slurm_time), ("slurm_partition", safe_values.slurm_partition)):
            message = check(getattr(self, name))
            found += [(name, message)] if message else []
        found += [(f"slurm_extra.{i}", m) for i, m in enumerate(map(safe_values.slurm_option, self.slurm_extra)) if m]
        positive(found, "slurm_signal_seconds", self.slurm_signal_seconds)
        limit = safe_values.slurm_time_seconds(self.slurm_time) if not safe_values.slurm_time(self.slurm_time) else None
        if self.slurm_requeue and limit is not None and self.slurm_signal_seconds >= limit:
            found.append(("slurm_signal_seconds", f"got {self.slurm_signal_seconds} s with train.slurm_time="
                          f"{self.slurm_time} ({limit} s): the job would be signalled and requeued before it trains; "
                          "expected fewer seconds than the time limit (leave time to train and to write a checkpoint)"))
        if self.slurm_cpus_per_task < 0:
            found.append(("slurm_cpus_per_task", f"got {self.slurm_cpus_per_task}; expected 0 (the cluster's default) or a count of CPUs per rank"))
        for name, check in (("slurm_mem", safe_values.slurm_mem), ("slurm_container_image", safe_values.container_image)):
            message = check(getattr(self, name))
            found += [(name, message)] if message else []
        found += [(f"slurm_container_mounts.{i}", m)
                  for i, m in enumerate(map(safe_values.container_mount, self.slurm_container_mounts)) if m]
        return found
