"""The reward server's wire format: a request is one safetensors file (no pickle); the answer is JSON.

    POST /score   Content-Type: application/vnd.omnirl.score+safetensors
                  body: a safetensors file whose tensors are the outputs that are tensors, named ``outputs.<i>``,
                  with their own dtype, shape and bytes, and whose ``__metadata__["omnirl"]`` is JSON:
                  {"prompts": [str, ...], "outputs": [{"tensor": "outputs.<i>"} | {"text": str}, ...],
                   "inputs": [record | null, ...],          ("inputs" optional)
                   "files": {PATH: "files.<k>", ...}}       ("files" optional)
                  -> 200 {"scores": [float, ...]}   or   4xx / 5xx {"error": str}
    GET  /health  -> {"reward": NAME, "modality": [...], "uses_inputs": bool, "batch_invariant": bool,
                      "max_body_bytes": n, "requests": n, "batches": n, ...}

``files`` ships the files the records' media fields name (an edit's source and mask, a reference voice; see
``omnirl_core.contracts.data.MEDIA_KEYS``): each file's bytes as a uint8 tensor ``files.<k>``, keyed by the path the
record holds. The server writes them to a directory of its own for the request and hands its reward records that
name those copies, so a reward server needs no disk shared with the run.

The served reward sees the very tensors the in-process one sees: the same dtype, shape and bits (CPU,
contiguous). A score goes back as a JSON number written by ``repr(float)``, which reads back as the same double.
So a served reward gives bit for bit the in-process scores, as long as it is called with the same batches (the
server merges requests only for a ``batch_invariant`` reward, see ``omnirl_core.rewards.server``).

The format is safetensors' (an 8-byte little-endian header length, a JSON header, then the tensors' bytes), so
any safetensors library writes and reads it; the server reads it as it arrives (``read_request``): the header is
checked first, then the tensors' bytes go straight into one buffer, with nothing else of the body kept.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONTENT_TYPE = "application/vnd.omnirl.score+safetensors"
MAX_HEADER = 16 << 20  # prompts and records travel in the header: 16 MiB is thousands of long records
MAX_DIMS = 8
META_KEY = "omnirl"


class WireError(ValueError):
    """A request or answer that does not follow the wire format."""


def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


def _as_tensor(output: object) -> torch.Tensor:
    import torch

    x = output.detach() if isinstance(output, torch.Tensor) else torch.as_tensor(output)
    return x.cpu().contiguous()


class EncodedRequest:
    """A /score body, written as it is sent (``chunks``): nothing is copied beyond the CPU tensors themselves."""

    def __init__(self, outputs: Sequence[Any], prompts: Sequence[str], inputs: Sequence[Any] | None = None,
                 files: Mapping[str, bytes] | None = None):
        import torch

        if len(outputs) != len(prompts):
            raise WireError(f"{len(outputs)} outputs for {len(prompts)} prompts")
        names = {dtype: name for name, dtype in _dtypes().items()}
        items: list[dict[str, Any]] = []
        tensors: list[tuple[str, torch.Tensor]] = []
        for i, output in enumerate(outputs):
            if isinstance(output, str):
                items.append({"text": output})
                continue
            x = _as_tensor(output)
            if x.dtype not in names:
                raise WireError(f"cannot send outputs[{i}] of dtype {x.dtype}: expected one of "
                                f"{', '.join(str(d) for d in names)}")
            if x.dim() > MAX_DIMS:
                raise WireError(f"cannot send outputs[{i}] with {x.dim()} dimensions (at most {MAX_DIMS})")
            items.append({"tensor": f"outputs.{i}"})
            tensors.append((f"outputs.{i}", x))
        meta: dict[str, Any] = {"prompts": list(prompts), "outputs": items}
        if inputs is not None:
            meta["inputs"] = json.loads(json.dumps(list(inputs), default=str))
        if files:
            meta["files"] = {}
            for k, (path, data) in enumerate(files.items()):
                meta["files"][path] = f"files.{k}"
                tensors.append((f"files.{k}", torch.frombuffer(bytearray(data), dtype=torch.uint8)
                                if data else torch.empty(0, dtype=torch.uint8)))
        # widest elements first: every tensor's bytes then start at a multiple of its element size (the reader
        # can view them in place)
        tensors.sort(key=lambda nt: -nt[1].element_size())
        header: dict[str, Any] = {"__metadata__": {META_KEY: json.dumps(meta)}}
        offset = 0
        for name, x in tensors:
            size = x.numel() * x.element_size()
            header[name] = {"dtype": names[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
        self.head = struct.pack("<Q", len(raw)) + raw
        self.tensors = [x for _, x in tensors]
        self.length = len(self.head) + offset

    def chunks(self) -> Iterator[bytes | memoryview]:
        yield self.head
        for x in self.tensors:
            if x.numel():
                # numpy's stubs declare an array's buffer protocol from Python 3.12 on
                yield memoryview(x.reshape(-1).view(_u8()).numpy())  # type: ignore[arg-type, unused-ignore]

    def to_bytes(self) -> bytes:
        return b"".join(bytes(c) for c in self.chunks())


def _u8() -> torch.dtype:
    import torch

    return torch.uint8


def _loads(raw: bytes | str, what: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise WireError(f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"{what} is not valid JSON ({exc})") from None


def _read_exactly(read_into: Callable[[memoryview], int], view: memoryview, what: str) -> None:
    done = 0
    while done < len(view):
        n = read_into(view[done:done + (1 << 20)])
        if not n:
            raise WireError(f"the body ended inside {what} ({done} of {len(view)} bytes)")
        done += n


def _sizes(value: object) -> bool:
    return isinstance(value, list) and all(type(d) is int and 0 <= d < 1 << 48 for d in value)


def _tensor_entry(name: str, entry: object,
                  dtypes: dict[str, torch.dtype]) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise WireError(f"tensor {name!r}: expected 'dtype', 'shape' and 'data_offsets'")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in dtypes:
        raise WireError(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(dtypes)}")
    if not _sizes(shape) or len(shape) > MAX_DIMS:
        raise WireError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} sizes from 0 to 2**48")
    if not _sizes(offsets) or len(offsets) != 2:
        raise WireError(f"tensor {name!r}: data_offsets must be [begin, end], from 0 to 2**48")
    begin, end = offsets
    size = math.prod(shape) * dtypes[dtype].itemsize
    if end - begin != size:
        raise WireError(f"tensor {name!r}: {dtype} {shape} takes {size} bytes, its data_offsets span {end - begin}")
    return dtypes[dtype], tuple(shape), begin, end


ScoreRequest = tuple[list[Any], list[str], list[Any] | None, dict[str, "torch.Tensor"]]
"""A read /score body: outputs, prompts, inputs (or None), and the shipped files (path -> uint8 tensor of its
bytes)."""


def read_request(read_into: Callable[[memoryview], int], length: int) -> ScoreRequest:
    """A /score body of ``length`` bytes, read with ``read_into`` (a stream's ``readinto``) -> (outputs, prompts,
    inputs or None, files). Everything but the tensors' bytes is read and checked first, so a body that does not
    follow the format is refused after its header; the tensors are views of one buffer the size of their bytes."""
    import torch

    if length < 8:
        raise WireError(f"a body of {length} bytes is too short for a safetensors header")
    prefix = bytearray(8)
    _read_exactly(read_into, memoryview(prefix), "the header length")
    size = struct.unpack("<Q", prefix)[0]
    if size > min(length - 8, MAX_HEADER):
        raise WireError(f"the header length {size} is over the {min(length - 8, MAX_HEADER)} bytes left for it "
                        "(is the body a safetensors file?)")
    raw = bytearray(size)
    _read_exactly(read_into, memoryview(raw), "the header")
    header = _loads(bytes(raw), "the header")
    del raw
    if not isinstance(header, dict):
        raise WireError("the header must be a JSON object")
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not isinstance(metadata.get(META_KEY), str):
        raise WireError(f"the header has no __metadata__[{META_KEY!r}] (the prompts and outputs, as JSON text)")
    meta = _loads(metadata[META_KEY], f"__metadata__[{META_KEY!r}]")
    if not isinstance(meta, dict):
        raise WireError(f"__metadata__[{META_KEY!r}] must be a JSON object with 'prompts' and 'outputs'")
    prompts, items, inputs = meta.get("prompts"), meta.get("outputs"), meta.get("inputs")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError("'prompts' must be a list of strings")
    if not isinstance(items, list) or len(items) != len(prompts):
        raise WireError(f"'outputs' must be a list as long as 'prompts' ({len(prompts)})")
    if inputs is not None and (not isinstance(inputs, list) or len(inputs) != len(prompts)):
        raise WireError(f"'inputs' must be a list as long as 'prompts' ({len(prompts)}), or absent")
    shipped = meta.get("files") or {}
    if not isinstance(shipped, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shipped.items()):
        raise WireError("'files' must be an object from a path to the name of a tensor of the body, or absent")

    dtypes = _dtypes()
    entries = {name: _tensor_entry(name, entry, dtypes) for name, entry in header.items()}
    data = length - 8 - size
    end = 0
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        if begin != end:
            raise WireError(f"tensor {name!r} starts at byte {begin} of the data, not at {end}: tensors must "
                            "follow each other with no gap or overlap")
        end = stop
    if end != data:
        raise WireError(f"the tensors take {end} bytes, but the body has {data} after its header")
    used: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, dict) and set(item) == {"text"} and isinstance(item["text"], str):
            continue
        name = item.get("tensor") if isinstance(item, dict) and set(item) == {"tensor"} else None
        if not isinstance(name, str) or name not in entries or name in used:
            raise WireError(f"outputs[{i}]: expected {{'tensor': NAME}} naming a tensor of the body not named "
                            f"before, or {{'text': STR}}; got {str(item)[:100]}")
        used.add(name)
    for path, name in shipped.items():
        if name not in entries or name in used or entries[name][0] != _u8() or len(entries[name][1]) != 1:
            raise WireError(f"files[{path[:100]!r}]: expected the name of a 1-D uint8 tensor of the body not named "
                            f"before; got {name[:100]!r}")
        used.add(name)
    if len(used) != len(entries):
        raise WireError(f"tensors no output or file names: {sorted(set(entries) - used)[:5]}")

    buffer = torch.empty(data, dtype=torch.uint8)
    if data:
        _read_exactly(read_into, memoryview(buffer.numpy()),  # type: ignore[arg-type, unused-ignore]  # as above
                      "the tensors")
    tensors = {}
    for name, (dtype, shape, begin, stop) in entries.items():
        piece = buffer[begin:stop]
        if begin % dtype.itemsize:  # another writer's order: copy to an aligned buffer
            piece = piece.clone()
        tensors[name] = piece.view(dtype).reshape(shape)
    outputs = [tensors[item["tensor"]] if "tensor" in item else item["text"] for item in items]
    return outputs, prompts, inputs, {path: tensors[name] for path, name in shipped.items()}
