"""What things cost: a machine profile, the roofline, and the per-layer split it decides.

A profile is JSON (shipped ones in forecache/data/profiles/, or a file): host-to-device bandwidth,
device and host compute rates, and the fixed costs of the runtime's own steps. Compute time is a
roofline (`roofline_s`): a fixed launch cost plus the larger of bytes read at memory bandwidth and
arithmetic at the compute rate. The runtime plans by it and the simulator keeps time by it.

A missing expert either streams through a slot (its copy is on the critical path of the device
side) or has its tokens computed by the CPU from host memory while the device computes the rest of
the layer (schedule entries with slot -1). Per layer, `CostModel.choose_split` minimises the later
of the two sides finishing; at run time the measured copy rate and host compute time correct the
profile as they come in. With a disk tier, an expert missing from host memory is read from the
model file first, whichever side computes it; computing a whole layer on the host also reads the
experts the device holds and host memory does not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forecache.gguf.header import ModelFile

PROFILE_DIR = "data/profiles"

# What pageable host memory's copy rate is of pinned memory's, for a profile that does not give
# it (``Profile.h2d_pageable_gbps``). Measured on an H200 host (pinned H2D 55 GB/s) with the
# GPU check's model, Qwen2-57B-A14B Q4_K_M at a 24 GiB budget: stock llama.cpp's --n-cpu-moe
# prefilled a 512-token prompt in 341 ms with --no-mmap and 1067 ms with mmap. The prompt routes
# every expert, so each host layer's experts are copied up (about 11.7 GB at that budget, as the
# simulator splits it); at 55 GB/s that is 213 ms, which leaves mmap's copies about 940 ms:
# 12.5 GB/s, 0.23 of pinned (0.32 if the whole prefill were copies, which bounds it from above).
PAGEABLE_SHARE = 0.25


@dataclass(frozen=True)
class DiskProfile:
    """The disk under the host expert store (a profile's ``disk`` section): a read costs
    ``latency_us`` plus its bytes at ``gbps``, the reads in flight sharing ``gbps``."""

    gbps: float  # read rate with enough reads in flight
    latency_us: float  # fixed cost of one read, submission to its first byte
    queue_depth: int = 8  # reads forecache keeps in flight (its reader threads)
    readahead_kib: int = 128  # the kernel's read-around when a page of an mmap'd file faults
    source: str = ""

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    @property
    def readahead_bytes(self) -> int:
        return self.readahead_kib << 10


@dataclass(frozen=True)
class Profile:
    """A machine, as the simulator's timing model sees it."""

    name: str
    device: str
    h2d_gbps: float  # achieved host-to-device copy bandwidth
    chunk_latency_s: float  # fixed cost per copy
    gpu_mem_gbps: float  # weight-streaming bandwidth of device matmuls
    gpu_tflops: float  # effective device matmul rate
    gpu_launch_s: float  # fixed cost of one device op group (kernel launches)
    cpu_mem_gbps: float  # host expert compute: weight-streaming bandwidth
    cpu_gflops: float  # host expert compute: effective rate
    cpu_launch_s: float  # fixed cost of one host expert matmul
    hook_s: float  # gate hook on the critical path
    predictor_s: float  # one prediction on the predictor thread
    token_s: float = 0.0  # per forward pass, outside the graph: sampling, the Python runtime
    sample_s: float = 0.0  # per row with logits beyond the first: reading and sampling them
    # per sequence in a pass beyond the first: its KV stream's attention ops (llama.cpp keeps a
    # stream per sequence; its ops cost more than its context's bytes and flops say)
    seq_s: float = 0.0
    prefetch_hook_s: float = 0.0  # promoe's gate hook, when it costs more than hook_s (0: same)
    hook_row_s: float = 0.0  # a gate hook's further cost per row it routes (batch plans)
    group_s: float = 0.0  # an expert group computed as its own graph (gather, matmul, scatter)
    thread_s: float = 0.0  # starting and joining the CPU thread of a projection's host entries
    # a one-token gate decided in C from the policy's tables (forecache_cache_set_decode_gate)
    # instead of calling the Python hook (0: not modelled, such gates cost the hook)
    decode_gate_s: float = 0.0
    # Stock llama.cpp computes a host-resident MUL_MAT_ID on the device, copying the used experts
    # up first, when the ubatch has at least this many tokens (ggml-cuda.cu
    # ggml_backend_cuda_device_offload_op, GGML_OP_OFFLOAD_MIN_BATCH, default 32); 0: never (a
    # CPU build, where the device is the CPU).
    op_offload_min_batch: int = 32
    # Host DRAM bandwidth that host-to-device copies and CPU expert compute share (0: not
    # modelled, e.g. a CPU build whose fitted rates already include it)
    dram_gbps: float = 0.0
    # Host-to-device copy bandwidth from pageable host memory: weights llama.cpp mmaps from the
    # file (its default; ``h2d_gbps`` is pinned memory's, as --no-mmap and forecache load host
    # experts), which the driver stages through a pinned buffer. 0: PAGEABLE_SHARE of h2d_gbps
    h2d_pageable_gbps: float = 0.0
    # cards of this kind in the machine, each with its own link to the host at ``h2d_gbps``
    # (the per-card figures above), all sharing the host's DRAM (``dram_gbps``)
    devices: int = 1
    source: str = ""
    # the disk under the host expert store (None: none modelled; the JSON's "disk" object)
    disk: DiskProfile | None = None

    def __post_init__(self) -> None:
        if isinstance(self.disk, dict):  # from JSON, or a profile saved with asdict
            try:
                object.__setattr__(self, "disk", DiskProfile(**self.disk))
            except TypeError as e:
                raise ValueError(f"profile {self.name}: its disk section needs gbps and "
                                 f"latency_us (and may give queue_depth, readahead_kib, "
                                 f"source): {e}") from e

    def shared_dram_factor(self) -> float:
        """What copies and CPU expert compute each keep of their rate while both read DRAM."""
        return self.dram_factor(copy=True, cpu=True)

    def dram_factor(self, *, copy: bool, cpu: bool, disk: bool = False, copies: int = 1
                    ) -> float:
        """What each of the DRAM users running at once keeps of its rate: host-to-device
        copies (``copies`` of them at once, one per device link), CPU expert compute and disk
        reads landing in host memory, each at its full rate unless together they ask for more
        than ``dram_gbps``."""
        disk = disk and self.disk is not None
        n_copy = copies if copy else 0
        if n_copy + cpu + disk < 2:  # one user alone runs at its own rate
            return 1.0
        demand = (self.h2d_gbps * n_copy if copy else 0.0) + \
            (self.cpu_mem_gbps if cpu else 0.0) + \
            (self.disk.gbps if disk and self.disk is not None else 0.0)
        return min(1.0, self.dram_gbps / demand) if self.dram_gbps > 0 and demand > 0 else 1.0

    def pageable_gbps(self) -> float:
        """Host-to-device bandwidth from pageable (mmap'd) host memory."""
        return self.h2d_pageable_gbps if self.h2d_pageable_gbps > 0 else \
            PAGEABLE_SHARE * self.h2d_gbps

    @classmethod
    def load(cls, name_or_path: str) -> Profile:
        """A shipped profile by name (``rtx4090``) or a JSON file."""
        path = Path(name_or_path)
        if path.suffix == ".json" or path.exists():
            if not path.is_file():
                raise ValueError(f"profile {path} does not exist; give a JSON file or one of "
                                 f"{', '.join(shipped_profiles())}")
            text = path.read_text()
        else:
            ref = resources.files("forecache").joinpath(f"{PROFILE_DIR}/{name_or_path}.json")
            if not ref.is_file():
                raise ValueError(f"unknown profile {name_or_path!r}; shipped: "
                                 f"{', '.join(shipped_profiles())}, or give a JSON file")
            text = ref.read_text()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"profile {name_or_path}: not JSON ({e})") from e
        names = {f.name for f in fields(cls)}
        optional = {f.name for f in fields(cls) if f.default is not MISSING}
        missing = sorted(n for n in names - set(raw) - optional)
        if missing:
            raise ValueError(f"profile {name_or_path}: missing {', '.join(missing)}")
        return cls(**{k: v for k, v in raw.items() if k in names})


def shipped_profiles() -> list[str]:
    """Names of the profiles that come with forecache."""
    d = resources.files("forecache").joinpath(PROFILE_DIR)
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".json"))


@dataclass(frozen=True)
class ExpertShape:
    """One routed expert: model width, expert width, bytes of each projection."""

    d_model: int
    expert_ff: int
    proj_bytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.proj_bytes)

    @property
    def proj_flops(self) -> float:
        """Multiply-adds x2 of one token through one projection, on average: a gated expert's
        three d_model x expert_ff matrices, in three tensors or two (gate and up fused)."""
        return 6.0 * self.d_model * self.expert_ff / len(self.proj_bytes)

    @classmethod
    def of(cls, model: ModelFile) -> ExpertShape:
        """``model``'s routed expert, its projections' bytes averaged over the MoE layers
        (quantizers give some layers more bits; ``ModelFile.expert_proj_bytes``)."""
        return cls(int(model.arch_kv("embedding_length", 0)), model.expert_ff(),
                   model.expert_proj_bytes())


def roofline_s(launch_s: float, nbytes: float, mem_gbps: float, flops: float,
               flops_per_s: float) -> float:
    """Seconds of one op: its launch, then the larger of reading ``nbytes`` at ``mem_gbps`` and
    ``flops`` at ``flops_per_s``."""
    return launch_s + max(nbytes / (mem_gbps * 1e9), flops / flops_per_s)


def shared_dram(a_s: float, b_s: float, factor: float) -> tuple[float, float]:
    """When two jobs of ``a_s`` and ``b_s`` seconds alone (copies and CPU expert compute) start
    together and each keeps ``factor`` of its rate while both run: when each ends."""
    if a_s <= 0 or b_s <= 0 or factor >= 1:
        return a_s, b_s
    first = min(a_s, b_s) / factor  # the shorter ends; the other did as much work meanwhile
    rest = max(a_s, b_s) - min(a_s, b_s)
    return (first, first + rest) if a_s <= b_s else (first + rest, first)


# A ubatch of at least this many tokens computes every expert on the device unless the cost
# model's ``prompt_split``: llama.cpp's own threshold for computing host experts on the device
# (ggml-cuda's GGML_OP_OFFLOAD_MIN_BATCH). On a GPU the CPU's prompt rows cost more than their
# copies, and its threads slow the thread that launches the device's expert groups: on an H100
# with a 16-core host a 512-token prompt spent 343 ms computing split rows and 244 ms in groups,
# one after the other, of 677 ms (BENCHMARKS.md, "GPU: the check on an H100").
DEVICE_MIN_TOKENS = 32

# measurements below these are too small to correct the profile with
MIN_CALIBRATION_S = 0.02


# a layer's routed expert as the split sees it: (expert, token rows, has a slot) and, with a disk
# tier, whether it is in host memory (False: read from the model file first)
Row = tuple[int, int, bool] | tuple[int, int, bool, bool]


@dataclass(frozen=True)
class Split:
    """A layer's split: experts computed on the host beside the slots, or the whole layer there."""

    host: list[int]
    whole_layer: bool = False
    host_s: float = 0.0  # modelled CPU time of what goes to the host (alone on DRAM)


@dataclass
class CostModel:
    """Seconds of the two sides of a layer (rooflines per projection, as the simulator's): the
    device copying missing experts and computing from slots, and the host CPU computing experts
    from host memory."""

    expert: ExpertShape
    copy_gbps: float
    chunk_latency_s: float
    gpu_mem_gbps: float
    gpu_tflops: float
    gpu_launch_s: float
    cpu_mem_gbps: float
    cpu_gflops: float
    cpu_launch_s: float
    thread_s: float = 0.0  # handing a projection's host entries to their CPU thread
    dram_factor: float = 1.0  # what copies and CPU compute keep of their rates while both run
    host_scale: float = 1.0  # measured / modelled host compute time
    predicted_host_s: float = 0.0  # modelled time of what was sent to the host so far
    copy_measured: bool = False  # copy_gbps comes from the run, not the profile
    disk_gbps: float = 0.0  # the disk tier's read rate with its reads in flight (0: no disk)
    disk_latency_s: float = 0.0  # one read's fixed cost, submission to first byte
    prompt_split: bool = False  # the split also for ubatches of DEVICE_MIN_TOKENS or more
    # measured / modelled device compute of expert groups, where the device's compute is not the
    # profile's (an RPC server's: another machine's processor, each group a network round trip)
    dev_scale: float = 1.0
    calibrate_device: bool = False  # correct dev_scale from the groups' measured time
    # the host entries of a layer are computed whole, every projection in one hand-off to the CPU,
    # while each projection is one product over the slots that also reads a spare slot for each
    # of them (fc_whole_start); else (a disk tier) projection by projection beside expert groups
    whole_host: bool = True

    @classmethod
    def from_profile(cls, profile: Profile, expert: ExpertShape) -> CostModel:
        p = profile
        return cls(expert, p.h2d_gbps, p.chunk_latency_s, p.gpu_mem_gbps, p.gpu_tflops,
                   p.gpu_launch_s, p.cpu_mem_gbps, p.cpu_gflops, p.cpu_launch_s, p.thread_s,
                   p.shared_dram_factor(),
                   disk_gbps=p.disk.gbps if p.disk is not None else 0.0,
                   disk_latency_s=p.disk.latency_s if p.disk is not None else 0.0)

    def reads_s(self, n: int) -> float:
        """``n`` whole experts read from the model file, several in flight: the first read's
        latency, then their bytes at the disk's rate (0 without a disk)."""
        if n <= 0 or self.disk_gbps <= 0:
            return 0.0
        return self.disk_latency_s + n * self.expert.nbytes / (self.disk_gbps * 1e9)

    def fill_s(self, n: float) -> float:
        """A prompt bank's fill of ``n`` whole experts: one copy on a stream of its own."""
        return self.chunk_latency_s + n * self.expert.nbytes / (self.copy_gbps * 1e9)

    def copy_s(self) -> float:
        """One whole expert, host to device."""
        n = len(self.expert.proj_bytes)
        return self.expert.nbytes / (self.copy_gbps * 1e9) + n * self.chunk_latency_s

    def dev_s(self, n_experts: int, pairs: int) -> float:
        """``pairs`` token-expert rows over ``n_experts`` experts in slots, every projection."""
        return self._dev_model_s(n_experts, pairs) * self.dev_scale

    def _dev_model_s(self, n_experts: float, pairs: float) -> float:
        """``dev_s`` by the profile's device rooflines alone."""
        if n_experts == 0:
            return 0.0
        fl = pairs * self.expert.proj_flops
        return sum(roofline_s(self.gpu_launch_s, n_experts * nb, self.gpu_mem_gbps, fl,
                              self.gpu_tflops * 1e12) for nb in self.expert.proj_bytes)

    def host_s(self, n_experts: int, pairs: int) -> float:
        """``pairs`` token-expert rows over ``n_experts`` experts, every projection, on the host."""
        if n_experts == 0:
            return 0.0
        fl = pairs * self.expert.proj_flops
        t = sum(roofline_s(self.cpu_launch_s, n_experts * nb, self.cpu_mem_gbps, fl,
                           self.cpu_gflops * 1e9) for nb in self.expert.proj_bytes)
        return t * self.host_scale

    def merge_proj_s(self, pairs: int) -> float:
        """Host rows of one projection of a split layer: the CPU thread that computes them,
        inputs read back, results written into the device's (a copy each way and a scatter
        launch)."""
        nbytes = 4.0 * pairs * (self.expert.d_model + self.expert.expert_ff)
        return (self.thread_s + self.gpu_launch_s + self.chunk_latency_s
                + nbytes / (self.copy_gbps * 1e9))

    def whole(self) -> bool:
        """Whether a split layer's host entries are computed whole (``whole_host``, and no disk
        tier: its host slots are read projection by projection)."""
        return self.whole_host and self.disk_gbps <= 0

    def merge_s(self, pairs: int) -> float:
        """Host rows of a split layer, every projection: one hand-off when computed whole (the
        layer's input read back and its output rows written, at the fitted cost of one), else
        one a projection."""
        if self.whole():
            return (self.thread_s + self.gpu_launch_s + self.chunk_latency_s
                    + 8.0 * pairs * self.expert.d_model / (self.copy_gbps * 1e9))
        return len(self.expert.proj_bytes) * self.merge_proj_s(pairs)

    def splits(self, tokens: int) -> bool:
        """A ubatch of ``tokens`` may compute experts on the host (else every one is copied and
        computed on the device: ``DEVICE_MIN_TOKENS``)."""
        return tokens < DEVICE_MIN_TOKENS or self.prompt_split

    def choose_split(self, rows: Sequence[Row], in_flight: int, tokens: int = 1) -> Split:
        """The cheapest way to compute a layer whose experts are ``rows`` (expert, token rows,
        has a slot[, in host memory]) for a ubatch of ``tokens``; ``in_flight`` of those with a
        slot are still being copied.

        Missing experts with the fewest rows go to the host first, as many as make the later
        side finish soonest (every prefix is tried: the host's launches and the merge are fixed
        costs worth paying only for enough experts); computing the whole layer on the host, as
        the reactive baselines do, is the alternative. With a disk tier a missing expert not in
        host memory is read whichever side computes it, so its read does not change the choice;
        the whole layer on the host also reads the experts the device holds and the host does
        not (``best_split``). A ubatch the split is not for (``splits``) stays on the device."""
        split, _ = self.best_split(rows, in_flight, tokens)
        self.predicted_host_s += split.host_s / self.host_scale
        return split

    def best_split(self, rows: Sequence[Row], in_flight: int, tokens: int = 1
                   ) -> tuple[Split, float]:
        """``choose_split``'s choice and the seconds it expects the layer's experts to take, less
        the reads every choice makes."""
        missing = sorted(((r[0], r[1]) for r in rows if not r[2]), key=lambda m: (m[1], m[0]))
        n_all, pairs_all = len(rows), sum(r[1] for r in rows)
        c = self.copy_s()
        best_t = max(c * (in_flight + len(missing)), self.dev_s(n_all, pairs_all))
        if not self.splits(tokens):
            return Split([]), best_t
        best_k, best_host, pairs = 0, 0.0, 0
        for k, (_, r) in enumerate(missing, start=1):
            pairs += r
            alone = self.host_s(k, pairs)
            copy_t, host_t = shared_dram(c * (in_flight + len(missing) - k), alone,
                                         self.dram_factor)
            # computed whole, the host entries' rows still pass through the device's products
            on_dev = (n_all, pairs_all) if self.whole() else (n_all - k, pairs_all - pairs)
            dev = max(copy_t, self.dev_s(*on_dev))
            t = max(dev, host_t) + self.merge_s(pairs)
            if t < best_t:
                best_t, best_k, best_host = t, k, alone
        # on the host, the experts only the device holds are read first (fc_host_rows)
        whole = self.host_s(n_all, pairs_all) + \
            self.reads_s(sum(1 for r in rows if r[2] and len(r) > 3 and not r[3]))
        if whole < best_t:
            return Split([], whole_layer=True, host_s=whole), whole
        return Split([e for e, _ in missing[:best_k]], host_s=best_host), best_t

    def calibrate(self, h2d_bytes: int, copy_s: float, host_s: float,
                  other_host_s: float = 0.0, group_s: float = 0.0, group_entries: int = 0,
                  group_rows: int = 0) -> None:
        """Correct the profile with the engine's totals: copy rate, and host time against the
        modelled time of what was sent to the host (``predicted_host_s``, plus
        ``other_host_s`` planned outside this model, e.g. by the C decode gate's table); with
        ``calibrate_device``, the device's compute from its expert groups' time
        (``group_entries`` expert projections over ``group_rows`` token rows)."""
        if self.calibrate_device and group_s >= MIN_CALIBRATION_S and group_entries > 0:
            experts = group_entries / len(self.expert.proj_bytes)
            modelled = experts * self._dev_model_s(1, group_rows / group_entries)
            if modelled > 0:
                self.dev_scale = group_s / modelled
        if copy_s >= MIN_CALIBRATION_S and h2d_bytes > 0:
            n = len(self.expert.proj_bytes)
            per_expert = copy_s / (h2d_bytes / self.expert.nbytes) - n * self.chunk_latency_s
            if per_expert > 0:
                self.copy_gbps = self.expert.nbytes / per_expert / 1e9
                self.copy_measured = True
        predicted = self.predicted_host_s + other_host_s
        if host_s >= MIN_CALIBRATION_S and predicted > 0:
            self.host_scale = host_s / predicted
