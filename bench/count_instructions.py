"""Machine instructions the gateway executes per frame and per response, counted by valgrind (callgrind): an A/B of
two checkouts that the noise of a shared VM cannot blur.

    .venv/bin/python bench/count_instructions.py --gateway-root /tmp/before --gateway-root .

CPU time on this VM swings by 10-20 % from run to run, more than the differences a refactor makes; instructions
counted by callgrind are the same from run to run within ~1 %. The gateway runs under
``valgrind --tool=callgrind`` (20-50x slower: startup takes a minute or two), against bench_gateway's fake upstream;
the counters are zeroed after a warm-up (so startup, imports and the grammar's first compile are left out) and dumped
after each workload (``callgrind_control``). Each workload is also run with few frames, and the difference gives
the per-frame figure free of per-response costs:

* ``long``: one response of N argument deltas written back to back (bench_gateway's throughput phase);
* ``paced``: sequential responses of M deltas, one every ``--delay-ms`` (each frame a read of its own, as in the
  64 paced streams of bench_gateway's concurrent phase, without the concurrency).

Instructions are not time (a cache miss or a syscall costs more than its count says), but the same work costs the
same instructions, so a change that removes work shows here even when the clock cannot see it. Pass
``--upstream-version none`` (the default: the grammar takeover, the path issue 17's start commit had) or a vLLM
version (``0.32.0``: the one-request route).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gateway import REQUEST_BODY, connect, free_port, http_request, wait_port  # noqa: E402


def _total_ir(path: Path) -> int:
    """The instruction count of one callgrind dump (its ``summary:`` or ``totals:`` line)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


class Counted:
    """One gateway under callgrind; ``measure()`` runs a workload between a zero and a dump of its counters."""

    def __init__(self, root: Path, upstream: int, out: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.out = out
        self.dumps = 0
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p", "--dump-instr=no",
               sys.executable, "-m", "gateway", "serve", "--upstream", f"http://127.0.0.1:{upstream}",
               "--port", str(self.port), "--store", f"sqlite:///{out / 'gateway.db'}",
               *extra]
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=(out / "gateway.log").open("wb"), stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        wait_port(self.port, self.proc, timeout=600)

    def _control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", flag, str(self.proc.pid)], check=True, capture_output=True, timeout=120)

    async def measure(self, requests: int) -> tuple[int, int]:
        """Instructions and client frames for ``requests`` sequential responses of the upstream's current mode."""
        self._control("--zero")
        frames = 0
        for _ in range(requests):
            conn = await connect(self.port)
            res = await conn.request(http_request(self.port, "/v1/responses", REQUEST_BODY))
            assert res.ok, res
            frames += res.frames
            assert conn.transport is not None
            conn.transport.close()
        self._control("--dump")
        self.dumps += 1
        dump = max(self.out.glob(f"cg.{self.proc.pid}.*"), key=lambda p: p.stat().st_mtime)
        return _total_ir(dump), frames

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _mode(upstream: int, deltas: int, delay_ms: float) -> None:
    import orjson

    conn = await connect(upstream)
    body = orjson.dumps({"deltas": deltas, "delay_ms": delay_ms, "pacing": "step"})
    res = await conn.request(http_request(upstream, "/_bench/mode", body), keep_body=True)
    assert res.ok, res
    assert conn.transport is not None
    conn.transport.close()


async def run_root(root: Path, a: argparse.Namespace, upstream: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="gateway-ir-"))
    gw = Counted(root, upstream, out, a.gateway_arg)
    try:
        await _mode(upstream, 50, 0)
        for _ in range(3):  # warm-up: lazy imports, the grammar's compile, the pools
            await gw.measure(1)
        res: dict[str, float] = {}
        await _mode(upstream, a.deltas, 0)
        ir_long, frames_long = await gw.measure(1)
        await _mode(upstream, a.deltas // 10, 0)
        ir_short, frames_short = await gw.measure(1)
        res["long: instructions per frame"] = (ir_long - ir_short) / (frames_long - frames_short)
        res["long: instructions per response (short)"] = ir_short
        await _mode(upstream, a.paced_deltas, a.delay_ms)
        ir_paced, frames_paced = await gw.measure(a.paced_requests)
        await _mode(upstream, max(a.paced_deltas // 4, 1), a.delay_ms)
        ir_few, frames_few = await gw.measure(a.paced_requests)
        res["paced: instructions per response"] = ir_paced / a.paced_requests
        res["paced: instructions per frame (all in)"] = ir_paced / frames_paced
        res["paced: instructions per added frame"] = (ir_paced - ir_few) / (frames_paced - frames_few)
        return res
    finally:
        gw.stop()
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway-root", type=Path, action="append", required=True,
                   help="a checkout to count (give two or more for an A/B)")
    p.add_argument("--deltas", type=int, default=4000, help="argument deltas of the long response")
    p.add_argument("--paced-deltas", type=int, default=40)
    p.add_argument("--paced-requests", type=int, default=10)
    p.add_argument("--delay-ms", type=float, default=20.0, help="between paced frames (one read each under valgrind)")
    p.add_argument("--upstream-version", default="none")
    p.add_argument("--gateway-arg", action="append", default=[])
    p.add_argument("--keep", action="store_true", help="keep the callgrind dumps (callgrind_annotate reads them)")
    a = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is needed", file=sys.stderr)
        return 2
    up_port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", BENCH_UPSTREAM_VERSION=a.upstream_version)
    upstream = subprocess.Popen([sys.executable, str(HERE / "bench_gateway.py"), "--_upstream", str(up_port)], env=env,
                                stdout=subprocess.DEVNULL)
    try:
        wait_port(up_port, upstream)
        results = {}
        for root in a.gateway_root:
            started = time.monotonic()
            results[str(root)] = asyncio.run(run_root(root.resolve(), a, up_port))
            print(f"[ir] {root}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        upstream.terminate()
    names = list(results)
    rows = list(results[names[0]])
    width = max(len(r) for r in rows)
    print(f"{'':{width}s}  " + "  ".join(f"{n[-28:]:>28s}" for n in names))
    for row in rows:
        cells = [results[n][row] for n in names]
        ratio = f"  x{cells[-1] / cells[0]:.3f}" if len(cells) > 1 and cells[0] else ""
        print(f"{row:{width}s}  " + "  ".join(f"{c:28,.0f}" for c in cells) + ratio)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
