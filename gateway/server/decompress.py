"""Compressed request bodies (``Content-Encoding: zstd | gzip | deflate | br``), decoded as a stream.

Codex CLI sends its requests zstd-compressed (level 3); other clients gzip them. Every decoder here produces
its output in bounded pieces and counts it, so a body that is small on the wire but expands past
``--max-body-bytes`` is refused (413) after at most ``limit`` bytes of output, however large it claims to be:
a few KiB that inflate to a GiB cost neither memory nor time.

- gzip: ``zlib`` with ``max_length`` (concatenated gzip members, which RFC 1952 allows, are decoded in turn);
- deflate: ``zlib`` too, zlib-wrapped (RFC 9110) or raw deflate (what some clients send): the first two
  bytes tell which;
- br: ``brotli.Decompressor.process`` with ``output_buffer_limit`` (brotli >= 1.2);
- zstd: ``zstandard`` decompressobj, which has no output cap of its own, fed 64-byte slices: a zstd block
  (at most 128 KiB of output) costs at least 4 input bytes, so no call produces more than 2 MiB. Windows over
  8 MiB are refused, as RFC 9659 allows for the ``zstd`` content coding, so a frame header cannot make the
  decoder allocate more. Concatenated frames are decoded in turn (up to ``MAX_MEMBERS``, as gzip members).

A list (``Content-Encoding: gzip, zstd``: gzip applied first) is decoded in reverse order; ``identity`` is a
no-op. Unknown codings are a 415, bytes that do not decode a 400.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Iterator

from gateway.errors import InvalidBodyEncoding, PayloadTooLarge, UnsupportedContentEncoding

__all__ = ["SUPPORTED_CODINGS", "BodyDecoder", "body_decoder", "content_codings"]

SUPPORTED_CODINGS = ("zstd", "gzip", "deflate", "br")
_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 §8.4.1.3: x-gzip is gzip
MAX_CODINGS = 2  # stacked codings; each one holds a decoder (window) of its own
ZSTD_MAX_WINDOW = 8 * 1024 * 1024  # RFC 9659: the "zstd" content coding's window limit
MAX_MEMBERS = 1024  # concatenated gzip members / zstd frames in one body (each restart copies the chunk's rest)
_PIECE = 256 * 1024  # output per decoder call (zlib, brotli)
# zstd's worst expansion is 32768:1 (a 4-byte RLE block decodes to 128 KiB): 64 input bytes give <= 2 MiB.
# Decoding still runs at ~400 MiB/s of output for ordinary JSON.
_ZSTD_SLICE = 64
_YIELD_EVERY = 4 * 1024 * 1024  # give the event loop a turn after this much output


def content_codings(values: Iterable[str]) -> list[str]:
    """The codings named by the ``Content-Encoding`` header(s), in the order they were applied.

    Raises ``UnsupportedContentEncoding`` (415) for a coding the gateway cannot decode.
    """
    codings = []
    for value in values:
        for token in value.split(","):
            name = token.strip().lower()
            if not name or name == "identity":
                continue
            name = _ALIASES.get(name, name)
            if name not in SUPPORTED_CODINGS:
                raise _unsupported(f"Content-Encoding '{token.strip()[:64]}' is not supported")
            codings.append(name)
    if len(codings) > MAX_CODINGS:
        raise _unsupported(f"At most {MAX_CODINGS} stacked content codings are supported, not {len(codings)}")
    return codings


def _unsupported(what: str) -> UnsupportedContentEncoding:
    return UnsupportedContentEncoding(f"{what}; supported: {', '.join(SUPPORTED_CODINGS)} (or identity).",
                                      headers={"accept-encoding": ", ".join(SUPPORTED_CODINGS)})


def _corrupt(coding: str, detail: object) -> InvalidBodyEncoding:
    return InvalidBodyEncoding(f"The request body is not valid {coding} data ({detail}).")


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The decompressed request body exceeds the limit of {limit} bytes.")


class _Stage:
    """One coding's decoder: ``feed`` and ``finish`` yield output in bounded pieces."""

    coding: str

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.produced = 0

    def _count(self, piece: bytes) -> bytes:
        self.produced += len(piece)
        if self.produced > self.limit:
            raise _too_large(self.limit)
        return piece

    def feed(self, data: bytes) -> Iterator[bytes]:
        raise NotImplementedError

    def finish(self) -> Iterator[bytes]:
        raise NotImplementedError


class _ZlibStage(_Stage):
    """gzip (wbits 31) or deflate (zlib-wrapped, wbits 15, or raw, wbits -15)."""

    def __init__(self, coding: str, limit: int) -> None:
        super().__init__(limit)
        self.coding = coding
        self._head = b""  # deflate: bytes held until the first two tell zlib-wrapped from raw
        self._d: zlib._Decompress | None = None
        self._wbits = 31 if coding == "gzip" else 15
        self._members = 1

    def _start(self, data: bytes) -> bytes:
        if self.coding == "deflate":
            data = self._head + data
            if len(data) < 2:
                self._head = data
                return b""
            self._head = b""
            cmf, flg = data[0], data[1]
            self._wbits = 15 if cmf & 0x0F == 8 and cmf >> 4 <= 7 and (cmf << 8 | flg) % 31 == 0 else -15
        self._d = zlib.decompressobj(self._wbits)
        return data

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._d is None:
            data = self._start(data)
            if self._d is None:
                return
        d = self._d
        while data:
            if d.eof:  # a complete stream with input after it: a further gzip member, else an error
                if self.coding != "gzip":
                    raise _corrupt(self.coding, "data after the end of the stream")
                self._members += 1
                if self._members > MAX_MEMBERS:
                    raise _corrupt(self.coding, f"more than {MAX_MEMBERS} concatenated members")
                d = self._d = zlib.decompressobj(self._wbits)
            try:
                out = d.decompress(data, _PIECE)
                if out:
                    yield self._count(out)
                while len(out) == _PIECE and not d.unconsumed_tail and not d.eof:  # output still pending
                    out = d.decompress(b"", _PIECE)
                    if out:
                        yield self._count(out)
            except zlib.error as exc:
                raise _corrupt(self.coding, exc) from None
            data = d.unused_data if d.eof else d.unconsumed_tail

    def finish(self) -> Iterator[bytes]:
        if self._d is None or not self._d.eof:
            raise _corrupt(self.coding, "truncated")
        return iter(())


class _BrotliStage(_Stage):
    coding = "br"

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        import brotli  # here: most gateways never see a br body, and the module costs RSS in every process

        self._error = brotli.error
        self._d = brotli.Decompressor()

    def feed(self, data: bytes) -> Iterator[bytes]:
        d = self._d
        try:
            out = d.process(data, output_buffer_limit=_PIECE)
            if out:
                yield self._count(out)
            while not d.can_accept_more_data():
                out = d.process(b"", output_buffer_limit=_PIECE)
                if not out:
                    break
                yield self._count(out)
        except self._error as exc:
            raise _corrupt(self.coding, exc) from None

    def finish(self) -> Iterator[bytes]:
        if not self._d.is_finished():
            raise _corrupt(self.coding, "truncated")
        return iter(())


class _ZstdStage(_Stage):
    coding = "zstd"

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        import zstandard  # here, as brotli above

        self._error = zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._d = self._dctx.decompressobj(write_size=_PIECE)
        self._frames = 1

    def feed(self, data: bytes) -> Iterator[bytes]:
        view = memoryview(data)
        pos = 0
        carry = b""  # what a slice held past the end of a frame (< one slice)
        piece: bytes | memoryview
        try:
            while carry or pos < len(view):
                if self._d.eof:  # a frame ended: what follows is the next frame
                    self._frames += 1
                    if self._frames > MAX_MEMBERS:
                        raise _corrupt(self.coding, f"more than {MAX_MEMBERS} concatenated frames")
                    self._d = self._dctx.decompressobj(write_size=_PIECE)
                if carry:
                    piece, carry = carry, b""
                else:
                    piece, pos = view[pos : pos + _ZSTD_SLICE], pos + _ZSTD_SLICE
                out = self._d.decompress(piece)
                if self._d.eof:
                    carry = self._d.unused_data
                if out:
                    yield self._count(out)
        except self._error as exc:
            raise _corrupt(self.coding, exc) from None

    def finish(self) -> Iterator[bytes]:
        if not self._d.eof:  # no frame, or the last one cut short (a next frame only starts on input)
            raise _corrupt(self.coding, "truncated")
        return iter(())


def _stage(coding: str, limit: int) -> _Stage:
    if coding == "br":
        return _BrotliStage(limit)
    if coding == "zstd":
        return _ZstdStage(limit)
    return _ZlibStage(coding, limit)


class BodyDecoder:
    """Decodes a request body fed chunk by chunk; the decoded body never exceeds ``limit`` (413 past it)."""

    def __init__(self, codings: list[str], limit: int) -> None:
        self.limit = limit
        self._stages = [_stage(c, limit) for c in reversed(codings)]  # the last coding applied comes off first
        self._out: list[bytes] = []  # joined once at the end: no reallocations (copies) while it grows
        self._since_yield = 0

    def _push(self, i: int, data: bytes, final: bool) -> Iterator[bytes]:
        """``data`` through stages ``i..``; with ``final`` the stages are finished (end of body) too."""
        if i == len(self._stages):
            if data:
                yield data
            return
        stage = self._stages[i]
        if data:
            for piece in stage.feed(data):
                yield from self._push(i + 1, piece, False)
        if final:
            for piece in stage.finish():
                yield from self._push(i + 1, piece, False)
            yield from self._push(i + 1, b"", True)

    async def _collect(self, data: bytes, final: bool) -> None:
        for piece in self._push(0, data, final):
            self._out.append(piece)
            self._since_yield += len(piece)
            if self._since_yield >= _YIELD_EVERY:  # a large body: let other requests run meanwhile
                self._since_yield = 0
                await asyncio.sleep(0)

    async def feed(self, chunk: bytes) -> None:
        await self._collect(chunk, False)

    async def finish(self) -> bytes:
        """The decoded body; 400 when the input ended inside a stream."""
        await self._collect(b"", True)
        return b"".join(self._out)


def body_decoder(content_encoding: Iterable[str], limit: int) -> BodyDecoder | None:
    """A decoder for a body sent with these ``Content-Encoding`` header values; None for identity."""
    codings = content_codings(content_encoding)
    return BodyDecoder(codings, limit) if codings else None
