"""The card's own counters, as nvtop and nvitop read them: NVML through `pynvml`
(nvidia-ml-py, the `prefill` extra), beside tandem's own count of the bytes it copies.

`NvmlReader(ordinal).read()` is one `GpuReading`: PCIe bytes/s each way (NVML samples a
20 ms window, so a read takes that long twice: call it off the event loop), the link as
negotiated now and at most, utilisation, memory, temperature and power. A field is None where
its call raises an `NVMLError` (`NVMLError_NotSupported` on many consumer cards and in VMs);
the reading is None, never an error, where there is no NVML, no GPU, or no card for the
ordinal. NVML is initialised on the first read and the handle kept; the link's maximum does
not change, so it is asked once.

Which card: CUDA counts devices its own way (`CUDA_VISIBLE_DEVICES` hides and reorders them,
and by default it puts the fastest first) while NVML counts every card in PCI order. The PCI
bus id settles it where torch gives one (`get_device_properties(i).pci_bus_id`, with its
domain and device); else the `CUDA_VISIBLE_DEVICES` entry for the ordinal (an index or a
`GPU-` uuid); else the ordinal itself.

A card that idles drops its link to a lower generation (Gen1 on most) to save power: the
current generation says what the link can do only while the card works.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

KIB = 1024  # NVML's PCIe throughput is in KB/s of 1024 bytes
# one lane's rate after line coding, bytes/s: Gen1-2 8b/10b at 2.5 and 5 GT/s, Gen3-5
# 128b/130b at 8, 16 and 32 GT/s, Gen6 64 GT/s PAM4 in 242/256 flits
LANE_Bps = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969.2e6, 5: 3938.5e6, 6: 7563e6}


@dataclass(frozen=True)
class GpuReading:
    """One look at the card (`nodes/contract/gauges.py` GPU_GAUGES says each field); None:
    not supported there."""

    pcie_rx_Bps: float | None = None  # bytes/s into the card (host→device)
    pcie_tx_Bps: float | None = None  # bytes/s out of it
    link_gen: int | None = None  # PCIe generation now
    link_width: int | None = None  # lanes now
    link_gen_max: int | None = None
    link_width_max: int | None = None
    util_pct: int | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: int | None = None
    power_w: float | None = None

    def to_json(self) -> dict[str, int | float]:
        """`/health`'s `gpu`: the fields known, unknown ones left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def below_max(self) -> bool:
        """Whether the link runs slower or narrower now than it can (both known)."""
        g, w, g_max, w_max = self.link_gen, self.link_width, self.link_gen_max, self.link_width_max
        if g is None or w is None or g_max is None or w_max is None:
            return False
        return g < g_max or w < w_max


def link_Bps(gen: int | None, width: int | None) -> float | None:
    """A PCIe link's rate one way, bytes/s, before packet overheads; None when not known."""
    if gen is None or width is None or gen not in LANE_Bps:
        return None
    return LANE_Bps[gen] * width


class NvmlReader:
    """The NVML counters of the card CUDA calls `ordinal`. `nvml`: the `pynvml` module (a fake
    in tests), imported on the first read when not given; `bus_id`: the card's PCI bus id,
    which picks it over any index."""

    def __init__(
        self, ordinal: int = 0, *, nvml: ModuleType | None = None, bus_id: str | None = None
    ) -> None:
        self.ordinal = ordinal
        self.bus_id = bus_id
        self._nvml = nvml
        self._handle: Any = None
        self._failed = False  # no NVML or no such card: every read is None, at no cost
        self._max: tuple[int | None, int | None] | None = None

    def read(self) -> GpuReading | None:
        """The card now; None without NVML or the card."""
        if self._handle is None and not self._open():
            return None
        nv, h = self._nvml, self._handle
        assert nv is not None
        if self._max is None:
            self._max = (self._get(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                         self._get(nv.nvmlDeviceGetMaxPcieLinkWidth, h))  # fmt: skip
        rx = self._get(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES)
        tx = self._get(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
        util = self._get(nv.nvmlDeviceGetUtilizationRates, h)
        mem = self._get(nv.nvmlDeviceGetMemoryInfo, h)
        power_mw = self._get(nv.nvmlDeviceGetPowerUsage, h)
        return GpuReading(
            pcie_rx_Bps=None if rx is None else float(rx * KIB),
            pcie_tx_Bps=None if tx is None else float(tx * KIB),
            link_gen=self._get(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
            link_width=self._get(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
            link_gen_max=self._max[0],
            link_width_max=self._max[1],
            util_pct=None if util is None else int(util.gpu),
            mem_used_bytes=None if mem is None else int(mem.used),
            mem_total_bytes=None if mem is None else int(mem.total),
            temp_c=self._get(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            power_w=None if power_mw is None else power_mw / 1000,
        )

    def close(self) -> None:
        """Let NVML go (its init is counted: torch's own use of it stays)."""
        if self._handle is not None and self._nvml is not None:
            self._handle = None
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as e:
                log.debug("nvmlShutdown: %s", e)

    def _get(self, fn: Any, *args: Any) -> Any:
        assert self._nvml is not None
        try:
            return fn(*args)
        except self._nvml.NVMLError:  # NotSupported on this card, or it failed just now
            return None

    def _open(self) -> bool:
        if self._failed:
            return False
        self._failed = True  # until the handle is found
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                log.info("no pynvml (the prefill extra's nvidia-ml-py): the card's counters off")
                return False
            self._nvml = pynvml
        nv = self._nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            log.info("NVML is not here (%s): the card's counters off", e)
            return False
        try:
            self._handle = self._find(nv)
        except nv.NVMLError as e:
            log.info("NVML has no card for cuda:%d (%s): its counters off", self.ordinal, e)
            nv.nvmlShutdown()
            return False
        self._failed = False
        return True

    def _find(self, nv: ModuleType) -> Any:
        if self.bus_id:
            return nv.nvmlDeviceGetHandleByPciBusId(self.bus_id)
        visible = _visible(os.environ.get("CUDA_VISIBLE_DEVICES"), self.ordinal)
        if visible is not None and visible.startswith(("GPU-", "MIG-")):
            return nv.nvmlDeviceGetHandleByUUID(visible)
        index = int(visible) if visible is not None and visible.isdigit() else self.ordinal
        return nv.nvmlDeviceGetHandleByIndex(index)


def _visible(devices: str | None, ordinal: int) -> str | None:
    """The `CUDA_VISIBLE_DEVICES` entry CUDA calls `ordinal`; None when it is not set (or
    names fewer devices)."""
    if not devices:
        return None
    entries = [e.strip() for e in devices.split(",")]
    return entries[ordinal] if ordinal < len(entries) else None


def reader_for(device: str) -> NvmlReader | None:
    """The reader for a node's torch device (`cuda`, `cuda:1`); None for any other."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    ordinal = int(index) if index.isdigit() else 0
    return NvmlReader(ordinal, bus_id=_torch_bus_id(ordinal))


def _torch_bus_id(ordinal: int) -> str | None:
    """The card's PCI address as NVML takes it, `00000000:01:00.0`, where torch says it."""
    import torch

    try:
        props = torch.cuda.get_device_properties(ordinal)
    except (AssertionError, RuntimeError) as e:  # torch without CUDA, or no such device
        log.debug("no CUDA device %d for NVML: %s", ordinal, e)
        return None
    bus = getattr(props, "pci_bus_id", None)
    if not isinstance(bus, int):
        return None
    domain, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def link_of(device: str) -> str:
    """A card's PCIe link as NVML says it, "Gen4 x8 (of Gen4 x16)" where it runs below what
    it can, "Gen4 x16" where not; "" for no card, no NVML, or a card that does not say."""
    reader = reader_for(device)
    if reader is None:
        return ""
    try:
        r = reader.read()
    finally:
        reader.close()
    if r is None or r.link_gen is None or r.link_width is None:
        return ""
    now = f"Gen{r.link_gen} x{r.link_width}"
    return f"{now} (of Gen{r.link_gen_max} x{r.link_width_max})" if r.below_max else now
