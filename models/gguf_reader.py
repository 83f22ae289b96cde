"""A GGUF (v2/v3) file parser: header, metadata key/values, tensor infos, memory-mapped data.

It owns the file format only. It does not dequantize (`models.gguf_dequant`) and does not know
HF names or configs (`models.loader.gguf`). Tensor data is never copied into RAM here: each
tensor is handed out as a uint8 numpy view onto one copy-on-write `np.memmap` of the file.
Long metadata arrays (a tokenizer's ~100k strings) are decoded only when asked for.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types (gguf_type in llama.cpp's gguf.h).
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = (
    range(13)
)

_SCALAR_DTYPES: dict[int, np.dtype] = {
    UINT8: np.dtype("<u1"),
    INT8: np.dtype("<i1"),
    UINT16: np.dtype("<u2"),
    INT16: np.dtype("<i2"),
    UINT32: np.dtype("<u4"),
    INT32: np.dtype("<i4"),
    FLOAT32: np.dtype("<f4"),
    BOOL: np.dtype("<u1"),
    UINT64: np.dtype("<u8"),
    INT64: np.dtype("<i8"),
    FLOAT64: np.dtype("<f8"),
}

# metadata arrays longer than this are decoded on first access (`GGUFMetadata`)
LAZY_ARRAY_LEN = 256

# ggml tensor types: id -> (name, elements per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this parser understands; the message says why."""


def ggml_type_name(ggml_type: int) -> str:
    entry = GGML_TYPES.get(ggml_type)
    return entry[0] if entry else f"unknown ggml type {ggml_type}"


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry. `shape` is in GGUF order: `shape[0]` (ne0) is the fastest dim."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major (torch/numpy) shape: GGUF's dims reversed."""
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            elem_type, count = self.unpack("<IQ")
            return self.array(elem_type, count)
        dtype = _SCALAR_DTYPES.get(vtype)
        if dtype is None:
            raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")
        (v,) = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)
        self.pos += dtype.itemsize
        return bool(v) if vtype == BOOL else v.item()

    def array(self, elem_type: int, count: int) -> list[Any]:
        if elem_type in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[elem_type]
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return [bool(x) for x in arr] if elem_type == BOOL else arr.tolist()
        if elem_type == STRING:
            return [self.string() for _ in range(count)]
        return [self.value(elem_type) for _ in range(count)]  # arrays of arrays

    def skip(self, vtype: int) -> None:
        """Past one value without decoding it."""
        if vtype == STRING:
            self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif vtype == ARRAY:
            elem_type, count = self.unpack("<IQ")
            if elem_type in _SCALAR_DTYPES:
                self.pos += _SCALAR_DTYPES[elem_type].itemsize * count
            elif elem_type == STRING:  # a tokenizer's ~100k: one tight loop over the lengths
                pos, buf, length = self.pos, self.buf, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.skip(elem_type)
        elif vtype in _SCALAR_DTYPES:
            self.pos += _SCALAR_DTYPES[vtype].itemsize
        else:
            raise GGUFFormatError(f"unknown metadata value type {vtype} at byte {self.pos}")


@dataclass(frozen=True)
class _LazyArray:
    pos: int  # of the array's element type
    count: int


class GGUFMetadata(Mapping[str, Any]):
    """key -> python value of a file's metadata. An array longer than `LAZY_ARRAY_LEN` is
    decoded from the mapping each time it is read (a GGUF's tokenizer arrays are ~100k Python
    objects that only the tokenizer needs: decoding them for every config read fragments the
    heap); `array_len` gives its length without decoding it."""

    def __init__(self, buf: memoryview) -> None:
        self._buf = buf
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        value = self._values[key]
        if isinstance(value, _LazyArray):
            cur = _Cursor(self._buf, value.pos)
            return cur.value(ARRAY)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def array_len(self, key: str) -> int | None:
        """The length of array `key` (None: no such key, or not an array)."""
        value = self._values.get(key)
        if isinstance(value, _LazyArray):
            return value.count
        return len(value) if isinstance(value, list) else None

    def _read(self, key: str, vtype: int, cur: _Cursor) -> None:
        if vtype == ARRAY:
            count = struct.unpack_from("<Q", self._buf, cur.pos + 4)[0]
            if count > LAZY_ARRAY_LEN:
                self._values[key] = _LazyArray(cur.pos, count)
                cur.skip(ARRAY)
                return
        self._values[key] = cur.value(vtype)


class GGUFReader:
    """Parse a GGUF file's header; tensor data stays on disk behind a memmap.

    `metadata` maps key -> python value (int, float, bool, str, or list of those);
    `metadata_types` maps key -> the value type ids (`(ARRAY, elem_type)` for arrays);
    `tensors` maps name -> `GGUFTensorInfo`, in file order.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # copy-on-write mapping: writable views (torch.from_numpy needs that), the file is never changed
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="c")
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf, 4)
        self.version: int = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(
                f"{self.path}: GGUF version {self.version} not supported (2 and 3 are;"
                " a huge number means a big-endian file)"
            )
        n_tensors, n_kv = cur.unpack("<QQ")
        self.metadata = GGUFMetadata(buf)
        self.metadata_types: dict[str, tuple[int, ...]] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.unpack("<I")
            if vtype == ARRAY:
                elem_type = struct.unpack_from("<I", buf, cur.pos)[0]
                self.metadata_types[key] = (ARRAY, elem_type)
            else:
                self.metadata_types[key] = (vtype,)
            self.metadata._read(key, vtype, cur)

        self.alignment: int = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment % 8:
            raise GGUFFormatError(f"{self.path}: bad general.alignment {self.alignment}")
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            shape = tuple(int(x) for x in struct.unpack_from(f"<{n_dims}Q", buf, cur.pos))
            cur.pos += 8 * n_dims
            ggml_type, rel_offset = cur.unpack("<IQ")
            raw.append((name, shape, ggml_type, rel_offset))
        self.data_offset: int = -(-cur.pos // self.alignment) * self.alignment

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, rel_offset in raw:
            n_bytes = _tensor_nbytes(name, shape, ggml_type)
            offset = self.data_offset + rel_offset
            if offset + n_bytes > len(self._mmap):
                raise GGUFFormatError(f"{self.path}: tensor {name!r} runs past the end of the file")
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, n_bytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_data(self, name: str) -> np.ndarray:
        """The raw bytes of tensor `name`: a uint8 view onto the memmap, `[n_bytes]`; no copy."""
        info = self.tensors[name]
        return self._mmap[info.offset : info.offset + info.n_bytes]


def _tensor_nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    entry = GGML_TYPES.get(ggml_type)
    if entry is None:
        raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {ggml_type}")
    type_name, block_size, type_size = entry
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[0] % block_size:
        raise GGUFFormatError(
            f"tensor {name!r}: row length {shape[0]} is not a multiple of {type_name}'s block {block_size}"
        )
    return n // block_size * type_size
