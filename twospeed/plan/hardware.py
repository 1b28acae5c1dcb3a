"""Hardware profiles for the roofline: peak matmul FLOP/s per dtype and memory bandwidth.

Why: prefill is bounded by FLOP/s and decode by bytes/s, so the planner and the efficiency
report need both numbers for the machine in question. Built-in profiles carry the vendors'
public datasheet numbers (dense, no structured sparsity; cited beside each); `measure_local()`
measures this machine with a short torch probe (bf16 and fp32 matmul FLOP/s, copy bandwidth)
and returns a `LocalMeasurement` that converts to a profile, so the same roofline serves both.

No torch at import time: only `measure_local()` imports it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator or CPU socket, as the roofline sees it."""

    name: str  # the --hardware key
    description: str
    peak_flops: dict[str, float]  # dtype name ("bfloat16", "float32") -> dense matmul FLOP/s
    memory_bandwidth: float  # bytes/s the weights and KV cache stream from
    memory_bytes: float | None = None  # capacity, bytes (None: unknown)
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        if self.memory_bandwidth <= 0 or not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"hardware {self.name!r}: peak FLOP/s and bandwidth must be positive")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype`; float16 falls back to bfloat16 (same tensor-core rate)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "float16" and "bfloat16" in self.peak_flops:
            return self.peak_flops["bfloat16"]
        raise ValueError(f"hardware {self.name!r} has no peak FLOP/s for {dtype}; it has {sorted(self.peak_flops)}")


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 tensor 1,979 TFLOPS *with sparsity*
    # (989.4 dense), FP32 67 TFLOPS, HBM3 80 GB at 3.35 TB/s.
    HardwareProfile("h100-sxm", "NVIDIA H100 SXM 80GB", {"bfloat16": 989.4 * TERA, "float32": 67 * TERA},
                    3.35 * TERA, 80e9, "NVIDIA H100 datasheet (SXM; dense = half the sparsity figure)"),
    # NVIDIA H200 datasheet (SXM): same compute as H100 SXM; HBM3e 141 GB at 4.8 TB/s.
    HardwareProfile("h200-sxm", "NVIDIA H200 SXM 141GB", {"bfloat16": 989.4 * TERA, "float32": 67 * TERA},
                    4.8 * TERA, 141e9, "NVIDIA H200 datasheet (SXM; dense)"),
    # NVIDIA A100 datasheet, 80GB SXM: BF16 tensor 312 TFLOPS dense (624 sparse), FP32 19.5 TFLOPS,
    # HBM2e at 2,039 GB/s.
    HardwareProfile("a100-80gb", "NVIDIA A100 80GB SXM", {"bfloat16": 312 * TERA, "float32": 19.5 * TERA},
                    2039 * GIGA, 80e9, "NVIDIA A100 datasheet (80GB SXM; dense)"),
    # NVIDIA L40S datasheet: BF16 tensor 362.05 TFLOPS dense (733 with sparsity), FP32 91.6 TFLOPS, GDDR6 48 GB at
    # 864 GB/s (PCIe, no NVLink).
    HardwareProfile("l40s", "NVIDIA L40S 48GB", {"bfloat16": 362.05 * TERA, "float32": 91.6 * TERA},
                    864 * GIGA, 48e9, "NVIDIA L40S datasheet (dense = half the sparsity figure)"),
    # NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 tensor 4.5 PFLOPS with sparsity (2.25 dense), FP32 75 TFLOPS,
    # HBM3e 180 GB at 7.7 TB/s (the 1,000 W HGX part; the GB200 part is clocked higher).
    HardwareProfile("b200", "NVIDIA B200 180GB (HGX)", {"bfloat16": 2250 * TERA, "float32": 75 * TERA},
                    7.7 * TERA, 180e9, "NVIDIA HGX B200 datasheet, per GPU (dense = half the sparsity figure)"),
    # NVIDIA L4 datasheet: BF16 tensor 242 TFLOPS with sparsity (121 dense), FP32 30.3 TFLOPS,
    # GDDR6 24 GB at 300 GB/s.
    HardwareProfile("l4", "NVIDIA L4 24GB", {"bfloat16": 121 * TERA, "float32": 30.3 * TERA},
                    300 * GIGA, 24e9, "NVIDIA L4 datasheet (dense = half the sparsity figure)"),
    # Apple M3 Max (16-core CPU, 40-core GPU): Apple's spec page gives 400 GB/s unified memory
    # bandwidth. Apple publishes no FLOP/s; this is an estimate: 40 GPU cores x 128 FP32 ALUs x
    # 2 FLOP (FMA) x ~1.4 GHz = 14.3 TFLOPS, and the GPU runs bf16/fp16 at the fp32 rate.
    HardwareProfile("apple-m3-max", "Apple M3 Max (40-core GPU), 128GB",
                    {"bfloat16": 14.3 * TERA, "float32": 14.3 * TERA}, 400 * GIGA, 128e9,
                    "Apple M3 Max spec (bandwidth); FLOP/s estimated from core count and clock"),
    # A generic AVX-512 server CPU, one socket, modelled on a 56-core Intel Xeon Platinum 8480+
    # (Intel ARK: 56 cores, 2.0 GHz base): 2 AVX-512 FMA units x 16 fp32 lanes x 2 FLOP x 2.0 GHz
    # x 56 cores = 7.2 TFLOPS fp32; AVX512_BF16 (VDPBF16PS) doubles it for bf16 (AMX, not counted,
    # is far faster). Memory: 8 channels of DDR5-4800 x 8 bytes = 307.2 GB/s.
    HardwareProfile("cpu-avx512", "generic AVX-512 server CPU, one socket (56 cores, 8ch DDR5-4800)",
                    {"bfloat16": 14.3 * TERA, "float32": 7.2 * TERA}, 307.2 * GIGA, 512e9,
                    "Intel ARK (Xeon Platinum 8480+) and the DDR5-4800 channel rate; peak = lanes x FMA x clock"),
)}


@dataclass(frozen=True, slots=True)
class LocalMeasurement:
    """What `measure_local()` found; the best of several timed runs of each kernel."""

    device: str  # torch device string the probe ran on
    matmul_flops: dict[str, float] = field(default_factory=dict)  # dtype -> achieved FLOP/s
    copy_bandwidth: float = 0.0  # bytes/s, (read + written) / time of a large tensor copy
    matmul_size: int = 0  # square matrix side used
    copy_bytes: int = 0  # bytes of the copied tensor (each way)
    seconds: float = 0.0  # wall time of the whole probe

    def to_profile(self) -> HardwareProfile:
        return HardwareProfile("local", f"this machine ({self.device}, measured)", dict(self.matmul_flops),
                               self.copy_bandwidth, None, "measure_local(): timed torch matmul and copy")

    def to_dict(self) -> dict:
        return asdict(self)


def measure_local(device: str | None = None, seconds: float = 1.5,
                  dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> LocalMeasurement:
    """Measure matmul FLOP/s per dtype and copy bandwidth on `device` (default: cuda if present, else cpu).

    Each kernel is timed repeatedly within its share of `seconds` and the best rate is kept: the
    roofline is a ceiling, so the fastest run (least disturbed by other work) is the estimate.
    """
    import torch

    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    on_gpu = dev.type != "cpu"
    size = 8192 if on_gpu else 1024  # big enough to reach the peak, small enough for a ~0.3 s CPU run
    copy_elems = (1 << 30 if on_gpu else 1 << 26) // 4  # 1 GiB on a GPU, 64 MiB on a CPU (beyond its caches)
    budget = seconds / (len(dtypes) + 1)
    start = time.perf_counter()

    def best_time(fn) -> float:
        fn()  # warm-up: allocations, kernel selection
        sync()
        best, spent = float("inf"), 0.0
        while spent < budget or best == float("inf"):
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
        return best

    flops = {}
    for name in dtypes:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r}")
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)
        out = torch.empty(size, size, device=dev, dtype=dtype)
        flops[name] = 2 * size**3 / best_time(lambda: torch.mm(a, b, out=out))
        del a, b, out
    src = torch.empty(copy_elems, device=dev, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_bytes = src.numel() * src.element_size()
    bandwidth = 2 * copy_bytes / best_time(lambda: dst.copy_(src))  # read src + write dst
    del src, dst
    return LocalMeasurement(str(dev), flops, bandwidth, size, copy_bytes, time.perf_counter() - start)


def get_profile(name: str, *, device: str | None = None, probe_seconds: float = 1.5) -> HardwareProfile:
    """A built-in profile by name, or "local": this machine, measured now."""
    if name == "local":
        return measure_local(device, probe_seconds).to_profile()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {sorted(PROFILES)} or 'local'") from None
