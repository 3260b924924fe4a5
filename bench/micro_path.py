"""Micro-benchmark of the gateway's per-frame path, piece by piece, in one process (no sockets).

    .venv/bin/python bench/micro_path.py                 # the gateway in this checkout
    .venv/bin/python bench/micro_path.py --root /tmp/x   # a scratch copy (A/B of a proposed change)

Prints microseconds per upstream frame for: SSE parsing, translation (custom tool on), both together, a
takeover step's chat chunks continuing the call (per chat chunk), the drain guard around each upstream read, and
the ASGI send chain down to h11 (no socket). The workload is bench_gateway's: one ``apply_patch`` call streamed as N
argument deltas (or N content chunks), one HTTP chunk (so one pump iteration) per frame, as vLLM sends them.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, help="import the gateway package from this directory")
    p.add_argument("--deltas", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    if a.root:
        sys.path.insert(0, str(a.root.resolve()))
    sys.path.insert(1, str(HERE))
    import anyio
    import orjson
    from bench_gateway import REQUEST_BODY, build_workload

    import gateway
    from gateway.protocol.request import parse_request_body
    from gateway.protocol.sse import SseParser
    from gateway.translate.restore import build_request_state
    from gateway.translate.tool_context import resolve_tool_context
    from gateway.translate.translator import FunctionSseTranslator

    try:  # typed events (issue 17); an older checkout's translator takes (event, data) and returns SSE bytes
        from gateway.protocol.events import UpstreamEvent
        from gateway.protocol.sse import encode_events

        def feeder(t: Any) -> Callable[[str, str], list[Any]]:
            feed = t.feed
            return lambda ev, data: feed(UpstreamEvent(ev, data))

        def encoded(out: list[Any]) -> bytes:
            return encode_events(out)  # the SSE door's one join per batch
    except ImportError:
        def feeder(t: Any) -> Callable[[str, str], list[Any]]:
            return t.feed  # type: ignore[no-any-return]

        def encoded(out: list[Any]) -> bytes:
            return b"".join(out)

    w = build_workload(a.deltas)
    chunks = [*w.head, w.added, *w.deltas, *w.tail]
    n = len(chunks)
    body = parse_request_body(REQUEST_BODY)
    ctx = resolve_tool_context(body)
    print(f"gateway from {Path(gateway.__file__).parent}; {n} upstream frames per stream")

    def state() -> Any:
        return build_request_state(body, ctx, response_id="resp_x", created_at=1)

    # The translator is handed its id factory; a --root from before it was injected takes none.
    ids = {"ids": lambda prefix: f"{prefix}_bench"} if "ids" in inspect.signature(
        FunctionSseTranslator).parameters else {}

    parsed: list[tuple[str, str]] = []

    def parse_only() -> None:
        parser = SseParser()
        out = []
        for c in chunks:
            out += parser.feed(c)
        parsed[:] = out

    def translate_only() -> None:
        feed = feeder(FunctionSseTranslator(state(), **ids))
        for ev, data in parsed:
            feed(ev, data)

    client_frames: list[bytes] = [b""]

    def both() -> None:
        # Encoded per upstream read and the events dropped, as the server does: keeping every event of a 20,000-frame
        # stream alive would time the garbage collector walking them (a cost the server never pays).
        parser = SseParser()
        feed = feeder(FunctionSseTranslator(state(), **ids))
        sent: list[bytes] = []
        for c in chunks:
            out: list[Any] = []
            for ev, data in parser.feed(c):
                out += feed(ev, data)
            if out:
                sent.append(encoded(out))
        client_frames[0] = b"".join(sent)

    rows: list[tuple[str, float]] = []
    parse_only()
    rows.append(("SseParser.feed", best_of(parse_only, a.repeats)))
    rows.append(("FunctionSseTranslator.feed", best_of(translate_only, a.repeats)))
    rows.append(("parse + translate", best_of(both, a.repeats)))
    client_frames[:] = [f for f in client_frames[0].split(b"\n\n") if f]
    decoded = [orjson.loads(f.split(b"data: ", 1)[1]) for f in client_frames]
    text = "".join(e.get("delta", "") for e in decoded if e["type"] == "response.custom_tool_call_input.delta")
    assert text == w.expected_input, "translation changed the input"

    # -- the takeover's step (gateway.engine.takeover): chat chunks -> InputContinuation -> the same translator
    from gateway.enforce.constrain import InputContinuation
    from gateway.upstream.chat import chat_chunk_events

    chat = [w.chat_head, *w.chat_deltas, *w.chat_tail]
    added = orjson.loads(w.added.split(b"data: ", 1)[1])
    taken: list[bytes] = [b""]

    def takeover() -> None:
        tr = FunctionSseTranslator(state(), **ids)
        feed = feeder(tr)
        opening = SseParser()
        for c in [*w.head, w.added]:
            for ev, data in opening.feed(c):
                feed(ev, data)
        cont = InputContinuation(added, None, None)
        step = SseParser()
        for ev in cont.start() if hasattr(cont, "start") else ():  # an older checkout opens with a prefix event
            tr.feed(ev) if hasattr(ev, "event") else tr.feed(*ev)
        sent: list[bytes] = []
        for c in chat:
            out: list[Any] = []
            for _ev, data in step.feed(c):
                for ev in chat_chunk_events(data, cont):
                    out += tr.feed(ev) if hasattr(ev, "event") else tr.feed(*ev)
            if out:
                sent.append(encoded(out))
        taken[0] = b"".join(sent)

    # per chat chunk, printed per upstream frame below like the other rows
    rows.append(("takeover step: chat parse + continue + translate", best_of(takeover, a.repeats) * n / len(chat)))
    decoded = [orjson.loads(f.split(b"data: ", 1)[1]) for f in taken[0].split(b"\n\n") if f]
    text = "".join(e.get("delta", "") for e in decoded if e["type"] == "response.custom_tool_call_input.delta")
    assert text == w.expected_input, "the takeover changed the input"

    # -- async pieces: an async generator of the chunks, with and without the drain guard
    async def source() -> AsyncIterator[bytes]:
        for c in chunks:
            yield c

    async def consume(it: AsyncIterator[bytes]) -> None:
        async for _ in it:
            pass

    guard: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None
    try:
        from gateway.engine.drain import Drain
    except ImportError:  # before the engine (issue 17)
        try:
            from gateway.server.shutdown import Drain  # type: ignore[no-redef]
        except ImportError:
            Drain = None  # type: ignore[assignment,misc]
    if Drain is not None:
        guard = Drain().guard

    async def timed(make: Callable[[], AsyncIterator[bytes]]) -> float:
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            await consume(make())
            best = min(best, time.perf_counter() - t0)
        return best

    async def send_chain() -> float:
        """starlette/uvicorn-like send chain: three wrapper closures and h11 chunked encoding."""
        import h11

        conn = h11.Connection(h11.SERVER)
        conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        conn.next_event()
        conn.next_event()
        sink: list[bytes] = []
        conn.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))

        async def transport_send(message: dict[str, Any]) -> None:
            data = conn.send(h11.Data(data=message["body"]))
            if data:
                sink.append(data)

        async def wrap1(message: dict[str, Any]) -> None:
            await transport_send(message)

        async def wrap2(message: dict[str, Any]) -> None:
            await wrap1(message)

        async def wrap3(message: dict[str, Any]) -> None:
            await wrap2(message)

        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for f in client_frames:
                await wrap3({"type": "http.response.body", "body": f, "more_body": True})
            best = min(best, time.perf_counter() - t0)
            sink.clear()
        return best

    async def run_async() -> None:
        plain = await timed(source)
        rows.append(("async generator hop (baseline)", plain))
        if guard is not None:
            g = guard
            rows.append(("Drain.guard over it (extra)", await timed(lambda: g(source())) - plain))
        rows.append(("send chain + h11 encode (per client frame)", await send_chain() * n / len(client_frames)))

    anyio.run(run_async)

    print(f"{'piece':45s} {'us/upstream frame':>18s}")
    for name, secs in rows:
        print(f"{name:45s} {secs / n * 1e6:18.2f}")
    print(f"client frames: {len(client_frames)} (x{len(client_frames) / n:.3f} of upstream)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
