"""Wire types and SSE framing. No I/O, no clock: fresh ids and the time are handed in (``ids.IdFactory``,
``ids.Clock``); ``.importlinter`` holds the package to it, and mypy checks it strictly."""
