"""The TensorRT backend: a plan from `precast build --target tensorrt` behind the ModelRunner seam.

Running a plan needs an NVIDIA GPU; none has been available to this project, so the device part
(CudaPlanStep: TensorRT runtime + cuda-python) has never run. Everything around it is plain code
tested on CPU: TensorRTRunner turns each executor batch into the network's padded slot step
(runtime/tensorrt/lowering.py) and back, and NumpyStep runs that step by evaluating the same
lowering in numpy (`LLM(engine, backend="tensorrt-reference")`: slow, for checking, not serving).
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from precast import _C
from precast.engine.directory import Engine, numpy_dtype
from precast.errors import PrecastError
from precast.runtime.tensorrt.lowering import NetworkShape, check_supported, lower
from precast.runtime.tensorrt.numpy_ops import NumpyOps
from precast.runtime.tensorrt.trt_ops import quiet_logger


class StepExecutor(Protocol):
    """Runs one network step: inputs by name (caches excluded) -> logits [N, vocab]; owns the KV caches."""

    def allocate(self) -> None: ...  # zeroed KV caches for every slot of the plan
    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray: ...


@dataclass
class PlanRecord:
    """config.json's targets.tensorrt, checked."""

    plan: Path
    data: bytes  # the plan, read once: checked here, deserialized by CudaPlanStep
    builder: str
    builder_version: str
    activation_dtype: str


def plan_record(engine: Engine) -> PlanRecord:
    """The engine's plan, checked against its record: present, intact (sha256)."""
    record = engine.config.targets.get("tensorrt")
    if not record:
        raise PrecastError(f"{engine.path} has no TensorRT plan; build one with `precast build ... --target tensorrt` (or all)")
    plan = engine.path / record["plan"]
    if not plan.is_file():
        raise PrecastError(f"{engine.path}: the TensorRT plan {record['plan']} is missing; rebuild with --target tensorrt")
    data = plan.read_bytes()
    if hashlib.sha256(data).hexdigest() != record["plan_sha256"]:
        raise PrecastError(f"{plan} is corrupt (its sha256 differs from the one recorded at build); rebuild with --target tensorrt")
    return PlanRecord(plan, data, record["builder"], record["builder_version"], record["activation_dtype"])


def check_runtime_version(record: PlanRecord) -> Any:
    """The TensorRT module that built the plan, at the same version (plans do not load across versions)."""
    try:
        trt = importlib.import_module(record.builder)
    except ImportError:
        raise PrecastError(
            f"this plan was built by {record.builder} {record.builder_version}, which is not installed here; "
            f"install it (pip install {record.builder.replace('_', '-')}=={record.builder_version}) or rebuild "
            "the plan with the TensorRT installed here"
        ) from None
    if trt.__version__ != record.builder_version:
        raise PrecastError(
            f"this plan was built by {record.builder} {record.builder_version}, and {trt.__version__} is installed: "
            "TensorRT plans only load in the version that built them; rebuild with `precast build ... --target tensorrt`"
        )
    return trt


class TensorRTRunner(_C.ModelRunner):
    """Slot mode: the executor gives each running request one KV region (block id = slot)."""

    def __init__(self, engine: Engine, step: StepExecutor, activation_dtype: str):
        super().__init__()
        self.shape = NetworkShape.of(engine.config)
        self.spec = engine.config.model
        self.step = step
        self.element_bytes = numpy_dtype(activation_dtype).itemsize
        self.slot_lengths = [0] * self.shape.max_batch_size  # positions written per slot (filler goes after them)

    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def slot_mode(self) -> bool:
        return True

    def kv_block_bytes(self, tokens_per_block: int) -> int:
        """One slot: K and V of every layer over cache_len positions (max_seq_len + room for a padded step)."""
        _, heads, positions, head_dim = self.shape.kv_cache_shape(self.spec)
        return 2 * self.spec.num_layers * heads * positions * head_dim * self.element_bytes

    def configure_kv(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks > self.shape.max_batch_size:
            raise ValueError(
                f"the TensorRT plan has {self.shape.max_batch_size} slots (its --max-batch-size) and the KV "
                f"memory given holds {num_blocks}; give at most {self.shape.max_batch_size * self.kv_block_bytes(0)} bytes"
            )
        self.step.allocate()

    def forward(self, batch: Any) -> np.ndarray:
        feeds, slots = self.pack(batch)
        logits = self.step.run(feeds)
        for slot, end in slots:
            self.slot_lengths[slot] = end
        return logits[: batch.num_sampling()]  # a step that samples nothing still computes one (dummy) row

    def pack(self, batch: Any) -> tuple[dict[str, np.ndarray], list[tuple[int, int]]]:
        """The executor's packed batch as the network's padded step: each slot's new tokens first, filler
        after; idle slots write filler past their own tokens (never over them)."""
        S, shape = self.shape.max_batch_size, self.shape
        seqs = list(batch.sequences)
        step = max((s.num_tokens for s in seqs), default=0)
        if not seqs or step < 1:
            raise ValueError("an empty batch")
        if step > shape.max_num_tokens:
            raise ValueError(f"a step of {step} tokens for one request exceeds the plan's max_num_tokens {shape.max_num_tokens}")
        input_ids = np.zeros((S, step), np.int32)
        write = np.array(self.slot_lengths, np.int32)
        token_ids, last, slots = batch.token_ids, [], []
        for s in seqs:
            slot = s.block_table[0]
            if not 0 <= slot < S:
                raise ValueError(f"slot {slot} outside the plan's {S} slots")
            if s.context_len + s.num_tokens > shape.max_seq_len:
                raise ValueError(f"{s.context_len + s.num_tokens} positions exceed the plan's max_seq_len {shape.max_seq_len}")
            input_ids[slot, : s.num_tokens] = token_ids[s.token_offset : s.token_offset + s.num_tokens]
            write[slot] = s.context_len
            slots.append((slot, s.context_len + s.num_tokens))
            if s.sample:
                last.append(slot * step + s.num_tokens - 1)
        feeds = {
            "input_ids": input_ids,
            "position_ids": (write[:, None].astype(np.int64) + np.arange(step, dtype=np.int64)[None, :]),
            "write_indices": write,
            "kv_lengths": write + np.int32(step),  # with the lower-right causal mask: row r sees positions <= write + r
            "last_token_ids": np.array(last or [0], np.int32),
        }
        return feeds, slots


class NumpyStep:
    """The network evaluated in numpy (the lowering through NumpyOps), caches kept in host memory."""

    def __init__(self, engine: Engine, activation_dtype: str):
        check_supported(engine.config, activation_dtype)
        self.engine = engine
        self.act = activation_dtype
        self.caches: dict[str, np.ndarray] = {}

    def allocate(self) -> None:
        spec = self.engine.config.model
        shape = NetworkShape.of(self.engine.config).kv_cache_shape(spec)
        self.caches = {f"{k}_cache.{i}": np.zeros(shape, np.float32) for i in range(spec.num_layers) for k in "kv"}

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        ops = NumpyOps({**feeds, **self.caches})
        lower(ops, self.engine, self.act)
        for name in self.caches:  # the update is in place in TensorRT: k_cache_out.i is k_cache.i's memory
            self.caches[name] = ops.outputs[name.replace("_cache.", "_cache_out.")].value
        return ops.outputs["logits"].value


NO_GPU = (
    "backend 'tensorrt' runs TensorRT plans on an NVIDIA GPU, and this machine has none; use backend='cpu' to "
    "serve here, or backend='tensorrt-reference' to check the plan's network in numpy on the CPU"
)


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver reporting at least one GPU (checked without importing CUDA)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


class CudaPlanStep:  # pragma: no cover - GPU-only, never run in this project's CI
    """The plan on an NVIDIA GPU: TensorRT runtime, device memory and copies through cuda-python."""

    def __init__(self, trt: Any, record: PlanRecord, engine: Engine):
        if not has_nvidia_gpu():
            raise PrecastError(NO_GPU)
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            raise PrecastError("backend 'tensorrt' needs cuda-python beside TensorRT: pip install cuda-python") from None
        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0 or count < 1:
            raise PrecastError(
                "backend 'tensorrt' runs TensorRT plans on an NVIDIA GPU, and this machine has none "
                f"({cudart.cudaGetErrorString(err)[1].decode() if int(err) else 'no device'}); use backend='cpu'"
            )
        self.cudart, self.trt, self.engine = cudart, trt, engine
        self.plan = trt.Runtime(quiet_logger(trt)).deserialize_cuda_engine(record.data)
        if self.plan is None:
            raise PrecastError(f"{record.plan} did not load on this GPU (a target it was not built for?); rebuild it here")
        self.context = self.plan.create_execution_context()
        self.stream = self._check(cudart.cudaStreamCreate())
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)
        self.act = record.activation_dtype

    def _check(self, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise PrecastError(f"CUDA error {int(err)}: {self.cudart.cudaGetErrorString(err)[1].decode()}")
        return rest[0] if rest else None

    def _buffer(self, name: str, nbytes: int) -> int:
        ptr, size = self.buffers.get(name, (0, 0))
        if size < nbytes:
            if ptr:
                self._check(self.cudart.cudaFree(ptr))
            ptr = self._check(self.cudart.cudaMalloc(nbytes))
            self.buffers[name] = (ptr, nbytes)
        return ptr

    def allocate(self) -> None:
        s = self.engine.config.model
        nbytes = int(np.prod(NetworkShape.of(self.engine.config).kv_cache_shape(s))) * numpy_dtype(self.act).itemsize
        for i in range(s.num_layers):
            for k in "kv":
                ptr = self._buffer(f"{k}_cache.{i}", nbytes)
                self._check(self.cudart.cudaMemset(ptr, 0, nbytes))
                self.context.set_tensor_address(f"{k}_cache.{i}", ptr)
                self.context.set_tensor_address(f"{k}_cache_out.{i}", ptr)  # in place

    def run(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        cudart = self.cudart
        h2d, d2h = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, array in feeds.items():
            array = np.ascontiguousarray(array)
            ptr = self._buffer(name, array.nbytes)
            self._check(cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, h2d, self.stream))
            self.context.set_input_shape(name, array.shape)
            self.context.set_tensor_address(name, ptr)
        logits = np.empty((len(feeds["last_token_ids"]), self.engine.config.model.vocab_size), np.float32)
        out = self._buffer("logits", logits.nbytes)
        self.context.set_tensor_address("logits", out)
        if not self.context.execute_async_v3(self.stream):
            raise PrecastError("TensorRT failed to run the step (its log says why)")
        self._check(cudart.cudaMemcpyAsync(logits.ctypes.data, out, logits.nbytes, d2h, self.stream))
        self._check(cudart.cudaStreamSynchronize(self.stream))
        return logits


def make_tensorrt_runner(engine: Engine, reference: bool = False) -> TensorRTRunner:
    """backend 'tensorrt': the plan on this machine's GPU (checked: plan intact, same TensorRT version, a GPU
    present). reference=True ('tensorrt-reference'): the same network evaluated in numpy on the CPU."""
    record = plan_record(engine)
    if reference:
        return TensorRTRunner(engine, NumpyStep(engine, record.activation_dtype), record.activation_dtype)
    trt = check_runtime_version(record)
    if not has_nvidia_gpu():  # at once, before any device work
        raise PrecastError(NO_GPU)
    return TensorRTRunner(engine, CudaPlanStep(trt, record, engine), record.activation_dtype)
