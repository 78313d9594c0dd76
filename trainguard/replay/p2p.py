"""Bytes between ranks, point to point: a micro-batch sent to the data-parallel peer that replays it.

A payload is a plain serialisation of tensors, lists, tuples, dicts and numbers (``torch.save``, read back
with ``weights_only=True``: nothing in it can run code on the receiver), with every tensor on the host; each
tensor that lived on an accelerator is put back on the receiver's own device. A batch that does not serialise
that way (an object of your own in it) is sent as nothing, decided by the sender alone -- so every rank of a
model-parallel group, whose batches have the same types, skips it alike.

:func:`exchange` sends and receives in two rounds (sizes, then the bytes) with ``batch_isend_irecv``, on the
collective's device (NCCL moves only device tensors). Every rank calls it with the peers it sends to and
receives from; a rank with nothing to move calls nothing.
"""
from __future__ import annotations

import io
from typing import Any, Iterable

import torch


def _mapped(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):  # (a plain dict: what a weights-only load gives back)
        return {k: _mapped(v, fn) for k, v in x.items()}
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_mapped(v, fn) for v in x)
    if isinstance(x, list):
        return [_mapped(v, fn) for v in x]
    return x


def _safe_globals() -> list:
    from trainguard.faults.poison import OutputPoison  # (a micro-batch's own nan_batch poison travels with it)

    return [OutputPoison]


def encode(obj: Any) -> bytes:
    """``obj`` as bytes, or b"" when it does not survive a weights-only load (checked here, by the sender)."""
    accel: list[bool] = []

    def host(t: torch.Tensor) -> torch.Tensor:
        accel.append(t.device.type != "cpu")
        return t.detach().cpu()

    buf = io.BytesIO()
    try:
        torch.save({"obj": _mapped(obj, host), "accel": accel}, buf)
        data = buf.getvalue()
        if len(data) > MAX_BYTES:  # (a micro-batch too large to send: its peer does not replay it)
            return b""
        decode(data, torch.device("cpu"))
    except Exception:  # noqa: BLE001 - not a plain batch: it is not sent
        return b""
    return data


MAX_BYTES = 1 << 30  # the most one payload may take (the receiver allocates what the sender announces)


def received(data: bytes | None, device: torch.device) -> Any:
    """A peer's payload decoded, or None when there is none or it does not decode -- on that rank alone, and never
    an exception: the ranks go on to the collective that follows together (one rank raising here would leave the
    others waiting for it until the collective timeout)."""
    if not data:
        return None
    try:
        return decode(data, device)
    except Exception:  # noqa: BLE001 - a payload that does not decode is no payload
        return None


def decode(data: bytes, device: torch.device) -> Any:
    """What :func:`encode` wrote, its accelerator tensors on ``device``. Raises on anything else."""
    with torch.serialization.safe_globals(_safe_globals()):
        box = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    accel = iter(box["accel"])

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(device) if next(accel) and device.type != "cpu" else t

    return _mapped(box["obj"], place)


def exchange(sends: dict[int, bytes], receives: Iterable[int], device: torch.device, group=None) -> dict[int, bytes]:
    """Send ``sends[peer]`` to each peer and receive one payload from each rank in ``receives`` (global ranks).
    Returns ``{rank: bytes}`` of what was received (b"": the sender had nothing)."""
    import torch.distributed as dist

    receives = sorted(set(receives))
    sends = {p: d for p, d in sends.items()}
    if not sends and not receives:
        return {}
    sizes_out = {p: torch.tensor([len(d)], dtype=torch.int64, device=device) for p, d in sends.items()}
    sizes_in = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in receives}
    _run([dist.P2POp(dist.isend, t, p, group) for p, t in sizes_out.items()]
         + [dist.P2POp(dist.irecv, t, p, group) for p, t in sizes_in.items()])
    bufs_out = {p: torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device) for p, d in sends.items() if d}
    too_big = {p: int(t.item()) for p, t in sizes_in.items() if int(t.item()) > MAX_BYTES}
    if too_big:  # (encode never sends one: a sender that does is broken -- named, not allocated)
        raise RuntimeError(f"peer payloads over {MAX_BYTES} bytes announced by ranks {too_big}: refused")
    bufs_in = {p: torch.empty(int(t.item()), dtype=torch.uint8, device=device) for p, t in sizes_in.items()
               if int(t.item())}
    _run([dist.P2POp(dist.isend, t, p, group) for p, t in bufs_out.items()]
         + [dist.P2POp(dist.irecv, t, p, group) for p, t in bufs_in.items()])
    return {p: bufs_in[p].cpu().numpy().tobytes() if p in bufs_in else b"" for p in receives}


def _run(ops: list) -> None:
    import torch.distributed as dist

    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
