"""Section ``loss-limit``: the fused linear cross-entropy against its floor, the three bare GEMMs.

A loss step (forward + backward) of a causal LM's output layer over ``N`` positions costs at least three GEMMs of
``2 N H V`` FLOPs each: the logits ``[N, H] x [H, V]``, the hidden states' gradient ``[N, V] x [V, H]`` and the
weight's gradient ``[V, N] x [N, H]``. The floor is exactly those three ``torch.mm`` calls, into preallocated
outputs, on the same shapes and dtype, in the same process. Measured against it, side by side:

* ``ours`` -- :func:`hf_accum.fused.loss.linear_cross_entropy_sum` (chunked, no full logits);
* ``torch`` -- torch's native ``F.linear_cross_entropy(..., options=nn.LinearCrossEntropyOptions())`` (its chunked
  path, "auto" policy), where the installed torch has it;
* ``trl`` -- TRL's fused LM head kernel (``trl.kernels.ChunkedLogProbFunction``, what ``SFTTrainer`` runs; torch ops
  on CPU), where TRL is installed. Liger-Kernel's is CUDA-only (Triton) and is listed as absent on CPU.

Each configuration first runs every variant once under the allocator's memory events (warm-up; ``peak`` = the
highest tensor bytes held above the inputs during the step, gradients included), then ``--loss-limit-rounds``
timed rounds in a rotating order (ours and the floor every round, the peers in the first). Times are wall
seconds; a ratio is a variant's time over the floor's *in the same round*, reported as the median and range.
The logits path (``F.cross_entropy(F.linear(h, W).float(), t, reduction="sum")``, what a stock model computes)
is measured for memory only, at ``--loss-limit-plain-positions`` (its ``[N, V]`` tensors do not fit a shared
machine at N = 4096), and extrapolated linearly in N (its peak is ``a + b N``; two points fit it, a third checks).
Targets, at vocab 128256, hidden 2048, N = 4096: ours <= 1.1x the floor in float32, <= 1.3x in bfloat16, and
ours' peak <= 0.25x the logits path's.

Each configuration runs in a fresh process (:class:`benchmarks.workers.Workers`) in which torch places its large CPU
tensors on transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``, for every variant, the floor included;
``--loss-limit-huge-pages false`` measures without). A step that allocates its outputs (every variant but the
floor, whose outputs are allocated and touched before it is timed) otherwise pays a page fault per 4 KiB: ~0.25 s
for a 1 GiB fp32 weight gradient (measured here), and the GEMMs reading the 1 GiB weight miss the TLB more. On this
machine the fp32 ratio of ours was 1.20x / 1.16x with huge pages against 1.26x / 1.23x without (alternating runs,
same load). A user's CPU run gets the same with ``THP_MEM_ALLOC_ENABLE=1`` in its environment.

    hf-accum bench --only loss-limit                         # the judged shape, float32 and bfloat16
    hf-accum bench --only loss-limit --loss-limit-quick      # one timed round, no peers
    hf-accum bench --only loss-limit --loss-limit-hidden-sizes 1024 2048 --loss-limit-vocab-sizes 32000 128256 262144
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

import torch
import torch.nn.functional as F
from transformers.hf_argparser import HfArg

from benchmarks.harness import Bench
from benchmarks.report import BenchError, SectionResult, judge, median_interval, require_positive, summary_row

if TYPE_CHECKING:
    from benchmarks.options import BenchOptions

JUDGED = (128256, 2048)  # (vocab, hidden) the targets are judged at, with N = 4096
JUDGED_POSITIONS = 4096
TIME_TARGET = {"float32": 1.1, "bfloat16": 1.3}
MEMORY_TARGET = 0.25
GiB = 2**30


@dataclass
class Options:
    _argument_group_name = "loss-limit section"

    loss_limit_positions: int = HfArg(default=JUDGED_POSITIONS, help="target positions N of the loss step")
    loss_limit_hidden_sizes: list[int] = HfArg(default_factory=lambda: [JUDGED[1]], help="hidden sizes H")
    loss_limit_vocab_sizes: list[int] = HfArg(default_factory=lambda: [JUDGED[0]], help="vocabularies V")
    loss_limit_dtypes: list[str] = HfArg(default_factory=lambda: ["float32", "bfloat16"],
                                         metadata={"choices": ["float32", "bfloat16"]}, help="dtypes")
    loss_limit_rounds: int = HfArg(default=2, help="timed rounds (ours and the floor in each, rotating order)")
    loss_limit_quick: bool = HfArg(default=False, help="one timed round, no peers")
    loss_limit_threads: int = HfArg(default=2, help="torch threads for this section (the targets: 2)")
    loss_limit_huge_pages: bool = HfArg(default=True, help="large CPU tensors on transparent huge pages "
                                                           "(THP_MEM_ALLOC_ENABLE=1) for every variant")
    loss_limit_plain_positions: list[int] = HfArg(
        default_factory=lambda: [512, 1024], help="positions the logits path's memory is measured at (extrapolated "
                                                  "linearly to N; give N itself on a machine with the memory)")


def validate(common: BenchOptions, options: Options) -> None:
    require_positive(loss_limit_positions=options.loss_limit_positions, loss_limit_rounds=options.loss_limit_rounds,
                     loss_limit_threads=options.loss_limit_threads)
    if common.device != "cpu":
        raise BenchError("loss-limit measures the CPU kernels (device='cpu'); its targets are set for 2 CPU threads")
    for name in ("loss_limit_hidden_sizes", "loss_limit_vocab_sizes"):
        values = getattr(options, name)
        if not values or min(values) < 2:
            raise BenchError(f"{name}={values}: give at least one, each at least 2")
    plain = options.loss_limit_plain_positions
    if len(set(plain)) < 2 or min(plain) < 1 or max(plain) > options.loss_limit_positions:
        raise BenchError(f"loss_limit_plain_positions={plain}: need two distinct values in 1..loss_limit_positions")


# ----------------------------------------------------------------------------------------------
# The variants: each returns a step (forward + backward, gradients freed) on the same inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Inputs:
    hidden: torch.Tensor  # [N, H], requires grad
    weight: torch.Tensor  # [V, H], requires grad
    targets: torch.Tensor  # [N]

    @classmethod
    def random(cls, positions: int, hidden: int, vocab: int, dtype: torch.dtype, seed: int) -> Inputs:
        generator = torch.Generator().manual_seed(seed)
        h = torch.randn(positions, hidden, generator=generator).to(dtype).requires_grad_()
        weight = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(dtype).requires_grad_()
        return cls(h, weight, torch.randint(0, vocab, (positions,), generator=generator))

    def backward(self, loss: torch.Tensor) -> float:
        loss.backward()
        self.hidden.grad = self.weight.grad = None  # freed inside the window: every variant allocates them alike
        return float(loss.detach())


def floor_step(inputs: Inputs) -> Callable[[], float]:
    """The three GEMMs of a loss step, nothing else, into outputs allocated and touched here (outside the timed
    call: their page faults are not the GEMMs' cost). The caller drops the step after timing it, so that the
    ``[N, V]`` output is not held while the other variants run."""
    h, weight = inputs.hidden.detach(), inputs.weight.detach()
    logits = h.new_zeros(h.shape[0], weight.shape[0])
    grad_hidden, grad_weight = torch.zeros_like(h), torch.zeros_like(weight)

    def step() -> float:
        torch.mm(h, weight.t(), out=logits)
        torch.mm(logits, weight, out=grad_hidden)
        torch.mm(logits.t(), h, out=grad_weight)
        return 0.0

    return step


def ours_step(inputs: Inputs) -> Callable[[], float]:
    from hf_accum.fused.loss import LinearHead, linear_cross_entropy_sum

    return lambda: inputs.backward(linear_cross_entropy_sum(inputs.hidden, LinearHead(inputs.weight), inputs.targets))


def torch_step(inputs: Inputs) -> Callable[[], float]:
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda: inputs.backward(F.linear_cross_entropy(
        inputs.hidden, inputs.weight, inputs.targets, reduction="sum", options=options))


def trl_step(inputs: Inputs) -> Callable[[], float]:
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    def step() -> float:
        log_probs = ChunkedLogProbFunction.apply(inputs.hidden, inputs.weight, None, inputs.targets, 1.0,
                                                 _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs",))[0]
        return inputs.backward(-log_probs.sum())

    return step


def plain_step(inputs: Inputs) -> float:
    """The logits path: full logits in the model's dtype, upcast, torch's cross-entropy."""
    logits = F.linear(inputs.hidden, inputs.weight).float()
    return inputs.backward(F.cross_entropy(logits, inputs.targets, reduction="sum"))


def available_peers() -> dict[str, Callable[[Inputs], Callable[[], float]] | str]:
    """Peer name -> step factory, or why it is absent."""
    peers: dict[str, Callable[[Inputs], Callable[[], float]] | str] = {}
    has_native = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
    peers["torch"] = torch_step if has_native else f"torch {torch.__version__} has no F.linear_cross_entropy"
    try:
        import trl.kernels  # noqa: F401

        peers["trl"] = trl_step
    except ImportError:
        peers["trl"] = "TRL not installed"
    peers["liger"] = "Liger-Kernel's fused linear cross-entropy is a Triton kernel (CUDA only)"
    return peers


# ----------------------------------------------------------------------------------------------
# Measuring one configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class ConfigResult:
    dtype: str
    hidden: int
    vocab: int
    positions: int
    floor_seconds: list[float] = field(default_factory=list)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[str, list[float]] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    plain_peaks: dict[int, int] = field(default_factory=dict)
    plain_peak_at_n: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)

    @property
    def judged(self) -> bool:
        return (self.vocab, self.hidden) == JUDGED and self.positions == JUDGED_POSITIONS

    @property
    def gflops_floor(self) -> float:
        return 3 * 2 * self.positions * self.hidden * self.vocab / statistics.median(self.floor_seconds) / 1e9


def _peak(step: Callable[[], float]) -> tuple[int, float]:
    from hf_accum.measure.memory import measure_memory

    with measure_memory(torch.device("cpu")) as reading:
        loss = step()
    return reading.peak_bytes, loss


def _plain_memory(result: ConfigResult, dtype: torch.dtype, points: list[int], seed: int) -> None:
    """The logits path's peak at a few N, then its value at ``result.positions`` from the first two (linear)."""
    for n in sorted(set(points)):
        inputs = Inputs.random(n, result.hidden, result.vocab, dtype, seed)
        result.plain_peaks[n], _ = _peak(lambda inputs=inputs: plain_step(inputs))
        del inputs
    (n1, p1), (n2, p2) = sorted(result.plain_peaks.items())[:2]
    result.plain_peak_at_n = p1 + (p2 - p1) / (n2 - n1) * (result.positions - n1)


def measure_config(dtype_name: str, hidden: int, vocab: int, options: Options, seed: int) -> ConfigResult:
    dtype = getattr(torch, dtype_name)
    result = ConfigResult(dtype_name, hidden, vocab, options.loss_limit_positions)
    _plain_memory(result, dtype, options.loss_limit_plain_positions, seed)
    inputs = Inputs.random(options.loss_limit_positions, hidden, vocab, dtype, seed)
    steps: dict[str, Callable[[], float]] = {"ours": ours_step(inputs)}
    if not options.loss_limit_quick:
        for name, peer in available_peers().items():
            if isinstance(peer, str):
                result.absent[name] = peer
            else:
                steps[name] = peer(inputs)
    floor_step(inputs)()  # warm-up
    for name, step in steps.items():  # warm-up and memory
        result.peak_bytes[name], result.losses[name] = _peak(step)
    rounds = 1 if options.loss_limit_quick else options.loss_limit_rounds
    for round_index in range(rounds):
        names = ["floor", *(n for n in steps if round_index == 0 or n == "ours")]
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # rotate the order so a drift in load favours no one
            step = floor_step(inputs) if name == "floor" else steps[name]
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            del step
            (result.floor_seconds if name == "floor" else result.seconds.setdefault(name, [])).append(elapsed)
        for name in names[1:]:
            result.ratios.setdefault(name, []).append(result.seconds[name][-1] / result.floor_seconds[-1])
    return result


# ----------------------------------------------------------------------------------------------
# The result
# ----------------------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


@dataclass
class LossLimitResult(SectionResult):
    DERIVED: ClassVar[tuple[str, ...]] = ()

    threads: int
    load_average: list[float]
    huge_pages: bool = True
    rows: list[ConfigResult] = field(default_factory=list)

    def text(self) -> str:
        load = ", ".join(f"{x:.1f}" for x in self.load_average)
        lines = [f"\nLoss step at its limit: forward + backward vs the 3 bare GEMMs (the floor), {self.threads} "
                 f"threads, load average before/after {load}; time = wall seconds, ratio = variant / floor in the same "
                 f"round (median [range]); peak = tensor bytes above the inputs; each configuration in a fresh process, "
                 f"large tensors {'on' if self.huge_pages else 'off'} transparent huge pages (THP_MEM_ALLOC_ENABLE="
                 f"{int(self.huge_pages)})"]
        for row in self.rows:
            floor = statistics.median(row.floor_seconds)
            lines.append(f"  {row.dtype} N={row.positions} H={row.hidden} V={row.vocab}: floor {floor:.2f} s "
                         f"({row.gflops_floor:.0f} GFLOP/s); logits path peak {row.plain_peak_at_n / GiB:.2f} GiB "
                         f"(extrapolated from N = {', '.join(map(str, sorted(row.plain_peaks)))})")
            for name, seconds in row.seconds.items():
                peak = row.peak_bytes[name]
                lines.append(f"    {name:<6} {statistics.median(seconds):8.2f} s  {_spread(row.ratios[name]):<22} "
                             f"peak {peak / GiB:6.2f} GiB = {peak / row.plain_peak_at_n:.2f}x logits path  "
                             f"loss {row.losses[name]:.4f}")
            for name, why in row.absent.items():
                lines.append(f"    {name:<6} absent: {why}")
        return "\n".join(lines)

    def summary(self) -> list[dict]:
        out = []
        for row in self.rows:
            if not row.judged:
                continue
            ratios = row.ratios["ours"]
            memory = row.peak_bytes["ours"] / row.plain_peak_at_n
            target = TIME_TARGET[row.dtype]
            passed = [judge(median_interval(ratios), target, at_least=False), memory <= MEMORY_TARGET]
            verdict = "FAIL" if False in passed else "PASS" if all(passed) else "UNMEASURED"
            out.append(summary_row(
                f"loss-limit {row.dtype} V={row.vocab} H={row.hidden}: fused / 3 GEMMs",
                f"time {_spread(ratios)}, memory {memory:.2f}x logits path",
                f"time <= {target}, memory <= {MEMORY_TARGET}", verdict,
            ))
        return out


def measure_config_in_child(dtype_name: str, hidden: int, vocab: int, options: dict, seed: int) -> ConfigResult:
    """:func:`measure_config` in a process of :class:`benchmarks.workers.Workers` (the options come as a dict)."""
    torch.set_num_threads(options["loss_limit_threads"])
    return measure_config(dtype_name, hidden, vocab, Options(**options), seed)


def _config_result(values: dict) -> ConfigResult:
    """A :class:`ConfigResult` back from its JSON form (JSON keys are strings: the logits path's N are ints)."""
    values["plain_peaks"] = {int(n): peak for n, peak in values["plain_peaks"].items()}
    return ConfigResult(**values)


def measure(bench: Bench, options: Options) -> LossLimitResult:
    from benchmarks.workers import Workers

    result = LossLimitResult(options.loss_limit_threads, [os.getloadavg()[0]], options.loss_limit_huge_pages)
    configs = [(d, h, v) for d in options.loss_limit_dtypes for h in options.loss_limit_hidden_sizes
               for v in options.loss_limit_vocab_sizes]
    huge_pages = {"THP_MEM_ALLOC_ENABLE": "1" if options.loss_limit_huge_pages else "0"}
    workers = Workers(options.loss_limit_threads, preload=["benchmarks.loss_limit"], env=huge_pages)
    try:
        with bench.progress(len(configs), "loss-limit configurations") as bar:
            for dtype_name, hidden, vocab in configs:
                spec = {"dtype_name": dtype_name, "hidden": hidden, "vocab": vocab,
                        "options": dataclasses.asdict(options), "seed": bench.options.seed}
                values = workers.call("benchmarks.loss_limit:measure_config_in_child", spec,
                                      f"loss-limit {dtype_name} H={hidden} V={vocab}")
                result.rows.append(_config_result(values))
                bar.update(1)
    finally:
        workers.close()
    result.load_average.append(os.getloadavg()[0])
    return result
